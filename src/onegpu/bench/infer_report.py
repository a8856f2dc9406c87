"""The report of `onegpu bench infer`: its result written as JSON, a Markdown table and a bar
chart."""

from __future__ import annotations

import json
from pathlib import Path


def write_outputs(result: dict, out_dir: str, stem: str) -> list[Path]:
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(to_markdown(result))
    plot(result, paths[2])
    return paths


COLUMNS = [
    ("setting", "setting", "{}"),
    ("prefill_tps", "prefill tok/s", "{:,.0f}"),
    ("decode_tps", "decode tok/s", "{:,.1f}"),
    ("decode_speedup", "decode vs HF", "{:.2f}x"),
    ("ttft_ms", "TTFT ms", "{:,.1f}"),
    ("peak_mb", "peak GPU MB", "{:,.0f}"),
    ("weight_mb", "weights MB", "{:,.1f}"),
    ("token_agreement", "greedy tokens = fp32", "{:.1%}"),
    ("argmax_agreement", "argmax = fp32", "{:.1%}"),
    ("max_logit_diff", "max abs logit diff", "{:.3g}"),
]


def to_markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# onegpu bench infer — {result['device']}",
        "",
        f"{result['date']}; model `{Path(c['model']).name}`, batch {c['batch_size']}, prompt "
        f"{c['prompt_len']} tokens, {c['new_tokens']} new tokens, median of {c['repeats']} "
        "interleaved repetitions.",
        "",
        "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in result["results"]:
        cells = ["n/a" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines += ["", f"Versions: {versions}.", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [r["setting"] for r in rows]
    panels = [
        ("prefill_tps", "prefill tokens/s"),
        ("decode_tps", "decode tokens/s"),
        ("weight_mb", "weights (MB)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.45 * len(names) + 1.5))
    for ax, (key, title) in zip(axes, panels, strict=True):
        values = [r[key] or 0 for r in rows]
        ax.barh(names, values, color=["#888888"] + ["#3b7dd8"] * (len(rows) - 1))
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle(f"onegpu bench infer — {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
