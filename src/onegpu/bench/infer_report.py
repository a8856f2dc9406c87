"""The report of `onegpu bench infer`: its result written as JSON, a Markdown page and a chart."""

from __future__ import annotations

import json
from pathlib import Path

from onegpu.bench import provenance


def write_outputs(result: dict, out_dir: str, stem: str) -> list[Path]:
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(to_markdown(result))
    plot(result, paths[2])
    return paths


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _span(value, rng, fmt: str) -> str:
    if value is None:
        return "n/a"
    if not rng:
        return fmt.format(value)
    return f"{fmt.format(value)} ({fmt.format(rng[0])}–{fmt.format(rng[1])})"


HEADER = (
    "setting",
    "how it decodes",
    "decode tok/s (range)",
    "ms / step (range)",
    "ms / step ÷ hf-default's (range)",
    "TTFT ms",
    "weights MB",
    "KV cache MB",
    "workspace MB",
    "peak MB",
    "MB read / step",
    "% of bandwidth",
    "greedy tokens = fp32",
    "load 1-min (range)",
)


def _cells(row: dict) -> list[str]:
    mem = row["memory_mb"]
    share = row["bandwidth_share"]
    return [
        row["setting"],
        row["note"],
        _span(row["decode_tps"], row["decode_tps_range"], "{:,.1f}"),
        _span(row["ms_per_step"], row["ms_per_step_range"], "{:,.2f}"),
        _span(row["ms_ratio"], row["ms_ratio_range"], "{:.2f}"),
        _num(row["ttft_ms"], "{:,.1f}"),
        _num(mem["weights"], "{:,.1f}"),
        _num(mem["kv"], "{:,.1f}"),
        _num(mem["workspace"], "{:,.1f}"),
        _num(mem["peak"], "{:,.1f}"),
        _num(row["bytes_per_step"] / 2**20, "{:,.1f}"),
        _num(None if share is None else 100 * share, "{:.1f}%"),
        _num(row.get("token_agreement"), "{:.1%}"),
        _span(row["load1"], row["load1_range"], "{:.2f}"),
    ]


def to_markdown(result: dict) -> str:
    c, bw = result["config"], result["bandwidth"]
    lines = [
        f"# onegpu bench infer — {result['device']}",
        "",
        provenance.markdown(result),
        f"Model `{Path(c['model']).name}` ({c['dtype']} unless a setting names "
        f"a dtype), prompt {c['prompt_len']} tokens, {c['new_tokens']} new tokens per prompt; "
        f"medians of {c['repeats']} interleaved rounds per batch size (rounds run: "
        f"{_rounds(result)}), range over rounds in brackets.",
        "",
    ]
    for batch in sorted({r["batch_size"] for r in result["results"]}):
        lines += [f"## Batch {batch}", "", "| " + " | ".join(HEADER) + " |"]
        lines.append("|" + "---|" * len(HEADER))
        for row in result["results"]:
            if row["batch_size"] == batch:
                lines.append("| " + " | ".join(_cells(row)) + " |")
        lines.append("")
    lines += _notes(result, bw)
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines += ["", f"Versions: {versions}.", ""]
    return "\n".join(lines)


def _rounds(result: dict) -> str:
    rounds = result.get("rounds") or {}
    return ", ".join(f"batch {b}: {n}" for b, n in rounds.items()) or "none"


def _notes(result: dict, bw: dict) -> list[str]:
    gbs = "n/a" if bw["gbs"] is None else f"{bw['gbs']:,.1f} GB/s"
    cuda = result["device_type"] == "cuda"
    lines = [
        "How to read it:",
        "",
        f"- **% of bandwidth** = MB read per decode step x steps/s ÷ the device's bandwidth, "
        f"{gbs} ({bw['source']}"
        + ("; median over rounds, one measurement before each round" if not cuda else "")
        + "). A step reads the weights it multiplies by (the input embedding table only where "
        "the output head is that table) and the K and V of every position each row attends "
        "(batch x mean context over the decode steps x KV bytes per position).",
        "- **ms / step**: one decode step = one new token for every row; decode tok/s = batch ÷ "
        "step time, over the steps after the first token. The ratio to hf-default pairs the "
        "calls of each round.",
        "- **TTFT** of the engine is the end of the engine step that computes the last piece of "
        "a request's prompt (prompts are computed in pieces of the token budget, several steps "
        "for a batch of long ones); generate's is stamped right after its prefill.",
    ]
    if cuda:
        lines.append(
            "- **Memory**: peak = weights (allocated by loading) + what the warm-up call left "
            "allocated (the engine's KV cache and state, CUDA-graph pools, a static cache) + how "
            "far a timed call rose above its start (torch.cuda.max_memory_allocated); the other "
            "settings' models, loaded at the same time, are not counted. KV cache: the engine's "
            "`cache.bytes`; generate's computed as batch x (prompt + new) x KV bytes/position. "
            "Workspace = peak - weights - KV cache."
        )
    else:
        lines.append(
            "- **Memory**: weights and KV cache only; peak and workspace are not measured on a "
            "CPU (its allocator keeps no peak count)."
        )
    for k in result.get("kv_sizing", []):
        lines.append(
            f"- **KV cache sized to the request** (batch {k['batch_size']}, {k['setting']}): "
            f"{k['positions']} positions per row, {k['engine_cache_mb']:,.1f} MB; sized to the "
            f"model's context ({k['context_positions']:,} positions) it would be "
            f"{k['context_cache_mb']:,.1f} MB."
        )
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [f"{r['setting']} @{r['batch_size']}" for r in rows]
    panels = [
        ("ms_per_step", "ms per decode step (lower is better)", 1),
        ("bandwidth_share", "% of the bandwidth limit", 100),
        ("ttft_ms", "time to first token, ms", 1),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.4 * len(names) + 1.5))
    colors = ["#888888" if r["path"] == "generate" else "#3b7dd8" for r in rows]
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        ax.barh(names, [(r[key] or 0) * scale for r in rows], color=colors)
        ax.set_title(title, fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(
        f"onegpu bench infer — {result['device']} (grey: generate, blue: engine)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
