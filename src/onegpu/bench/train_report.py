"""Results of `onegpu bench train`: one json document, the guide's table in markdown, a PNG chart.

All ratios come from one run: the median over rounds of the arm's value divided by the baseline
arm's value in the same round of the interleaved repetitions: "speed x" on real (non-padding) tokens
per second, "memory x" on the memory the training itself added (see bench_train_child.MemoryProbe).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from onegpu.bench.timing import fmt as _fmt
from onegpu.bench.timing import median as _median
from onegpu.bench.train_headline import (
    PEERS,
    compile_note,
    evidence,
    footer,
    headline,
    notes,
    opening,
    status,
    table,
)

# The libraries a training results page names.
PACKAGES = (
    "onegpu",
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "bitsandbytes",
    "datasets",
    "trl",
)
# What the guide's own table claims for each row: (improves speed, saves memory).
GUIDE = {
    "Batch size choice": ("Yes", "Yes"),
    "Gradient accumulation": ("No", "Yes"),
    "Gradient checkpointing": ("No", "Yes"),
    "Mixed precision": ("Yes", "(No)"),
    "Optimizer choice": ("Yes", "Yes"),
    "Data preloading": ("Yes", "No"),
    "torch.compile": ("Yes", "No"),
    "PEFT": ("No", "Yes"),
    "DeepSpeed ZeRO": ("No", "Yes"),
    "Flash Attention": ("Yes", "Yes"),
}

# Evidence that an arm's method really took effect: (field, test, what was expected).
_PEFT = ("peft", lambda v: v is True, "a PEFT model")
_TRL_COPY = ("reference", lambda v: str(v).startswith("frozen copy"), "TRL's frozen-copy reference")
ACTIVE = {
    "checkpointing": ("checkpointing", lambda v: v is True, "gradient checkpointing enabled"),
    "bf16": ("precision", lambda v: v == "bf16", "bf16 precision"),
    "fp32": ("precision", lambda v: v == "fp32", "fp32 precision"),
    "fp32-tf32": ("precision", lambda v: v == "fp32", "fp32 precision"),
    "adafactor": ("optimizer", lambda v: "adafactor" in str(v).lower(), "an Adafactor optimizer"),
    "adamw-8bit": ("optimizer_state_dtypes", lambda v: "torch.uint8" in (v or []),
                   "8-bit optimizer state"),
    "compile": ("compiled", lambda v: v is True, "compiled modules"),
    "fp8": ("float8_layers", lambda v: bool(v), "float8 Linear layers"),
    "lora": _PEFT,
    "qlora": _PEFT,
    "ref-copy": ("reference", lambda v: v == "CopyReference", "a frozen-copy reference"),
    "trl-dpo": _TRL_COPY,
    "trl-dpo-lora": _PEFT,
    "trl-kto": _TRL_COPY,
    "trl-kto-lora": _PEFT,
    "trl-reward": ("score_head", lambda v: str(v).endswith("ForSequenceClassification"),
                   "a sequence-classification model"),
    "trl-reward-lora": _PEFT,
}  # fmt: skip


def new_document(b, device, prep: dict, argv: list[str]) -> dict:
    """The results document before any arm ran: the provenance header (provenance.begin: command,
    commit, date, machine, load before), the device, versions, settings and setup."""
    import os

    from onegpu.bench import provenance

    cpu = f"{provenance.cpu_name()} ({os.cpu_count()} threads)"
    onegpu = argv and argv[0].endswith("onegpu")
    return {
        "benchmark": "onegpu bench train",
        # argv: the console script's, whose arguments already begin with `bench train`
        **provenance.begin("onegpu " + " ".join(argv[1:]) if onegpu else " ".join(argv)),
        "device": {
            "type": device.type,
            "name": device.name if device.type != "cpu" else cpu,
            "memory_gb": round(device.total_memory / 2**30, 1),
        },
        "versions": provenance.versions(PACKAGES),
        "config": dataclasses.asdict(b),
        "setup": prep,
        "schedule": [],
        "arms": {},
    }


def summarize(doc: dict) -> dict:
    """Medians per arm; speed and memory ratios against the baseline arm of this same run."""
    fpt, peak = doc["setup"]["flops_per_token"], doc["setup"]["peak_flops"]
    t = doc["config"]["training"]
    eff = t["micro_batch_size"] * t["grad_accum"]
    for arm in doc["arms"].values():
        ok = [r for r in arm["reps"] if r.get("status") == "ok" and r.get("timed_seconds", 0) > 0]
        if arm["status"] == "ok" and not ok:
            arm["status"] = "failed"
            errors = [r.get("error") for r in arm["reps"] if r.get("error")]
            arm["reason"] = (
                errors[0] if errors else "no timed steps (raise max_seconds or lower warmup_steps)"
            )
        for r in ok:
            r["tokens_per_s"] = r["timed_tokens"] / r["timed_seconds"]
            r["samples_per_s"] = r["timed_steps"] * eff / r["timed_seconds"]
            # the child's own peak, measured just before it trained: same machine load as its steps
            r["mfu"] = r["tokens_per_s"] * fpt / (r.get("peak_flops") or peak) if peak else None
            r["tokens_per_s_with_ref"] = with_reference_pass(r, t["max_steps"])
        for key in (
            "tokens_per_s",
            "samples_per_s",
            "mfu",
            "train_mem_mb",
            "peak_mem_mb",
            "final_loss",
            "tokens_per_s_with_ref",
            "reward_accuracy",
            "startup_s",
        ):
            arm[key] = _median([r.get(key) for r in ok])
        passes = [r["reference_pass"] for r in ok if r.get("reference_pass")]
        arm["reference_pass_s"] = _median([x.get("seconds") for x in passes])
        arm["reference_pass_warm_s"] = _median([x.get("warm_seconds") for x in passes])
        arm["tokens_per_s_range"] = (
            [min(r["tokens_per_s"] for r in ok), max(r["tokens_per_s"] for r in ok)] if ok else None
        )
        arm["inactive"] = _inactive(arm, ok)
    extra = {}  # GRPO: generation, training and the final reward, each paired with TRL's
    if doc["config"]["training"].get("objective") == "grpo":
        from onegpu.bench.train_grpo_report import GRPO_RATIOS, summarize_grpo

        summarize_grpo(doc)
        extra = GRPO_RATIOS
    base = doc["arms"].get("baseline", {})
    for arm in doc["arms"].values():
        arm["speed_x"] = paired_ratio(arm, base, "tokens_per_s")
        arm["memory_x"] = paired_ratio(arm, base, "train_mem_mb")
    for key, (ref, _, ours) in PEERS.items():
        hf = doc["arms"].get(ref, {})
        doc[key] = {  # SFT: our defaults, our loop with Trainer's default optimizer, our best set
            name: {
                "speed_x": paired_ratio(a, hf, "tokens_per_s"),
                "memory_x": paired_ratio(a, hf, "train_mem_mb"),
                "speed_x_with_ref": paired_ratio(a, hf, "tokens_per_s_with_ref"),
                **{k: paired_ratio(a, hf, figure) for k, figure in extra.items()},
            }
            for name, a in doc["arms"].items()
            if name in ours and a.get("tokens_per_s") and hf.get("tokens_per_s")
        }
    return doc


def with_reference_pass(rep: dict, max_steps: int) -> float:
    """Tokens/s with DPO's precomputed reference pass charged to the timed steps pro rata: the pass
    covers the pairs of all max_steps steps, so timed_steps / max_steps of it belongs to the timed
    ones. Its warm time is charged (the first pass also pays the process's start-up, which the other
    arms pay in their untimed steps); arms that compute the reference inside each step have nothing
    to add."""
    ref = rep.get("reference_pass") or {}
    seconds = (
        ref.get("warm_seconds", ref.get("seconds", 0.0)) * rep["timed_steps"] / max(max_steps, 1)
    )
    return rep["timed_tokens"] / (rep["timed_seconds"] + seconds)


def paired_ratio(arm: dict, ref: dict, key: str) -> Optional[float]:
    """Median over rounds of arm/ref within the same round: the two ran minutes apart, so a load
    change on a shared machine between rounds cancels out (a ratio of medians would keep it)."""
    ref_by_rep = {r.get("rep"): r.get(key) for r in ref.get("reps", []) if r.get(key)}
    ratios = [
        r[key] / ref_by_rep[r.get("rep")]
        for r in arm.get("reps", [])
        if r.get(key) is not None and ref_by_rep.get(r.get("rep"))
    ]
    return _median(ratios)


def _inactive(arm_doc: dict, ok: list[dict]) -> Optional[str]:
    check = ACTIVE.get(arm_doc.get("name", ""))
    if check is None or not ok:
        return None
    key, test, expected = check
    seen = ok[0].get("evidence", {}).get(key)
    return None if test(seen) else f"not active: expected {expected}, found {key}={seen}"


# ----------------------------------------------------------------------------------------- output
def write_all(doc: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(doc, paths["png"].name), encoding="utf-8")
    chart(doc, paths["png"])
    return paths


def markdown(doc: dict, png_name: str | None = None) -> str:
    if doc["config"]["training"].get("objective") == "grpo":
        from onegpu.bench.train_grpo_report import grpo_markdown

        return grpo_markdown(doc, png_name)
    if doc["config"]["training"].get("objective") in ("dpo", "kto", "reward"):
        from onegpu.bench.train_trl_report import preference_markdown

        return preference_markdown(doc, png_name)
    c, s, d = doc["config"], doc["setup"], doc["device"]
    t, b = c["training"], c["bench"]
    setup = (
        f"Model `{s['model_name']}` ({s['params'] / 1e6:.2f} M parameters), seq "
        f"{c['data']['seq_len']}, effective batch {t['micro_batch_size'] * t['grad_accum']} "
        f"({t['micro_batch_size']} x {t['grad_accum']}), {t['max_steps']} steps per arm (first "
        f"{b['warmup_steps']} untimed), {b['reps']} interleaved repetitions; medians. MFU against "
        f"measured {s['peak_dtype']} matmul peak {s['peak_flops'] / 1e9:.0f} GFLOP/s, "
        f"{s['flops_per_token'] / 1e6:.1f} MFLOP/token."
    )
    lines = opening(doc, f"Training methods on {d['name']}", setup) + headline(doc, PEERS)
    lines += [compile_note(doc), ""]
    rows = []
    for name, a in doc["arms"].items():
        guide = next((f"{v[0]} / {v[1]}" for k, v in GUIDE.items() if a["row"].startswith(k)), "")
        note = a.get("reason") or a.get("inactive") or peer_note(a)
        if a["status"] == "ok" and a.get("tokens_per_s_range"):
            lo, hi = a["tokens_per_s_range"]
            note = (note + "; " if note else "") + f"range {lo:,.0f}–{hi:,.0f} tok/s"
        rows.append(
            [a["row"], name, guide, _fmt(a.get("speed_x"), ".2f", "x")]
            + [_fmt(a.get("memory_x"), ".2f", "x"), _fmt(a.get("tokens_per_s"), ",.0f")]
            + [_fmt(a.get("startup_s"), ".1f"), _fmt(a.get("samples_per_s"), ".2f")]
            + [_fmt(a.get("mfu"), ".1%"), _fmt(a.get("train_mem_mb"), ",.0f")]
            + [_fmt(a.get("final_loss"), ".3f"), status(a) + note]
        )
    lines += table(
        "Method (guide row) | arm | guide: speed / memory | speed x | memory x | tokens/s | "
        "start-up s | samples/s | MFU | train mem MB | final loss | note",
        rows,
    )
    lines += footer(doc, [], "", png_name, "speed and memory against the baseline")
    return "\n".join(lines) + "\n"


def peer_note(arm: dict) -> str:
    """What a peer trainer's own defaults did (they differ from ours, so the table says so)."""
    if arm.get("kind") not in ("hf", "trl"):
        return ""
    ev = evidence(arm)
    loss = None
    if arm.get("kind") == "trl" and ev:
        loss = (
            f"{'chunked' if ev.get('chunked_loss') else 'full-logits'} loss "
            f"({ev.get('loss_type')}), {ev.get('loss_normalisation')}; TRL {ev.get('trl')}"
        )
    return notes(arm, "compiled" if ev.get("compiled") else None, loss)


def chart(doc: dict, path: Path) -> Path:
    """Two bar panels: speed x and memory x per arm that ran (1.0 = the baseline); for GRPO the
    reward curves and the ratios to TRL (train_grpo_report.chart)."""
    if doc["config"]["training"].get("objective") == "grpo":
        from onegpu.bench.train_grpo_report import chart as grpo_chart

        return grpo_chart(doc, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, a in doc["arms"].items() if a.get("speed_x") is not None]
    fig, axes = plt.subplots(
        1, 2, figsize=(10, 0.35 * max(len(names), 3) + 1.2), dpi=100, sharey=True
    )
    for ax, key, title in (
        (axes[0], "speed_x", "speed x (tokens/s)"),
        (axes[1], "memory_x", "memory x"),
    ):
        vals = [doc["arms"][n].get(key) or 0.0 for n in names]
        ax.barh(names, vals, color=["#4c72b0" if n != "baseline" else "#999999" for n in names])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.suptitle(f"onegpu bench train — {doc['device']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
