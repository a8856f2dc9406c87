"""The markdown of `onegpu bench train --objective dpo`: onegpu's DPO next to TRL's DPOTrainer.

The numbers are train_report.summarize's (medians over interleaved rounds, ratios paired per round);
this page says which arm computes its reference where, so a precomputed reference is never read as
free: its pass is shown on its own and charged in a column of its own.
"""

from __future__ import annotations

# What the bench sets on TRL's side to our run's values, and why (train_peers.hf_arguments,
# train_dpo.aligned_arguments); everything else is TRL's default.
ALIGNED = [
    (
        "model",
        "the same seeded weights (the same saved model on a GPU), built in the arm's process",
    ),
    (
        "pairs and their order",
        "the records our data code makes (`pairs.corpus_pairs`), in the order our loop draws them; "
        "TRL tokenizes them itself and the bench checks its ids equal ours pair by pair",
    ),
    (
        "steps, micro-batch x accumulation",
        "the same pairs per step; tokens/s counts the same real tokens",
    ),
    ("max length", "`max_length` = data.seq_len (TRL's default 1024); no pair here reaches it"),
    (
        "precision",
        "TRL defaults to bf16 autocast; set to the run's (fp32 on a CPU, bf16 on the GPU presets)",
    ),
    (
        "learning rate and schedule",
        "lr, cosine to the same floor, no warm-up, weight decay, Adam beta2, "
        "clipping, seed: TRL's default lr (1e-6) would make the losses incomparable",
    ),
    ("beta, label smoothing", "the loss itself (TRL's defaults 0.1 and 0 equal ours)"),
    ("LoRA (LoRA arms)", "the same adapters: r, alpha, dropout, target modules"),
]
KEPT = (
    "TRL's own defaults kept: its reference (a frozen copy of the model run inside every step for "
    "a full fine-tune; the adapters switched off for LoRA), gradient checkpointing on, padding to "
    "the longest sequence (ours: to a multiple of 64), its metrics every step, Trainer's fused "
    "AdamW."
)


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _vs_peer(doc: dict, name: str) -> dict:
    """This arm's ratios against its TRL counterpart (full with full, LoRA with LoRA); 1.00 for the
    peers."""
    for key in ("vs_trl_dpo", "vs_trl_dpo_lora"):
        if name in doc.get(key, {}):
            return doc[key][name]
    if name in ("trl-dpo", "trl-dpo-lora") and doc["arms"][name].get("tokens_per_s"):
        return {"speed_x": 1.0, "memory_x": 1.0, "speed_x_with_ref": 1.0}
    return {}


def _note(arm: dict) -> str:
    ev = next((r.get("evidence") for r in arm.get("reps", []) if r.get("evidence")), None) or {}
    bits = [ev.get("precision"), "checkpointing" if ev.get("checkpointing") else None]
    if ev.get("trainable_params") and ev.get("total_params"):
        bits.append(f"{ev['trainable_params'] / ev['total_params']:.0%} of weights train")
    if arm.get("kind") == "trl-dpo":
        bits.append(f"TRL {ev.get('trl')}, reference: {ev.get('reference')}")
    return ", ".join(b for b in bits if b)


def dpo_markdown(doc: dict, png_name: str | None = None) -> str:
    c, s, d = doc["config"], doc["setup"], doc["device"]
    t, b = c["training"], c["bench"]
    mem = next(
        (
            r.get("memory_kind")
            for a in doc["arms"].values()
            for r in a.get("reps", [])
            if r.get("memory_kind")
        ),
        "peak memory",
    )
    lines = [
        f"# DPO on {d['name']}: onegpu and TRL's DPOTrainer",
        "",
        f"{doc['date']} · `{doc['command']}`",
        "",
        f"Model `{s['model_name']}` ({s['params'] / 1e6:.2f} M parameters), {s['train_examples']} "
        f"preference pairs from the standard library, {t['micro_batch_size'] * t['grad_accum']} "
        f"pairs a step ({t['micro_batch_size']} x {t['grad_accum']}), sequences of at most "
        f"{c['data']['seq_len']} tokens, {t['max_steps']} steps per arm (first {b['warmup_steps']} "
        f"untimed), {b['reps']} interleaved rounds; medians, and the range over rounds. tokens/s "
        "counts the real tokens of the chosen and rejected sequences (prompt + response, both), "
        f"the same count in every arm. Memory: what training added to the process ({mem}). Ratios "
        "pair each round's arm with that round's TRL arm.",
        "",
    ]
    from onegpu.bench.train_headline import side

    for key, peer, label in (
        ("vs_trl_dpo", "trl-dpo", "TRL DPOTrainer (defaults)"),
        ("vs_trl_dpo_lora", "trl-dpo-lora", "TRL DPOTrainer, LoRA"),
    ):
        for name, vs in doc.get(key, {}).items():
            extra = ""
            if doc["arms"][name].get("reference_pass_s") is not None:
                extra = f" ({_fmt(vs.get('speed_x_with_ref'), '.2f', 'x')} with its reference pass)"
            sides = f" ({side(doc['arms'][name])}) vs {label} ({side(doc['arms'].get(peer, {}))})"
            lines.append(
                f"- **onegpu `{name}`{sides}: {_fmt(vs['speed_x'], '.2f', 'x')} "
                f"tokens/s{extra}, {_fmt(vs['memory_x'], '.2f', 'x')} memory.**"
            )
    lines += [
        "",
        "| arm | trainer, reference | tokens/s | range | reference pass s (warm / first) "
        "| tokens/s with reference pass | speed x TRL | train mem MB | memory x TRL | final loss "
        "| reward acc. | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in doc["arms"].items():
        vs = _vs_peer(doc, name)
        rng = a.get("tokens_per_s_range")
        ref = (
            f"{_fmt(a.get('reference_pass_warm_s'), '.2f')} / "
            f"{_fmt(a.get('reference_pass_s'), '.2f')}"
            if a.get("reference_pass_s") is not None
            else "in every step"
        )
        note = a.get("reason") or a.get("inactive") or _note(a)
        status = "" if a["status"] == "ok" else f"**{a['status']}** "
        lines.append(
            f"| {name} | {a['row']} | {_fmt(a.get('tokens_per_s'), ',.0f')} | "
            f"{'—' if not rng else f'{rng[0]:,.0f}–{rng[1]:,.0f}'} | "
            f"{ref if a['status'] == 'ok' else '—'} | "
            f"{_fmt(a.get('tokens_per_s_with_ref'), ',.0f')} | "
            f"{_fmt(vs.get('speed_x'), '.2f', 'x')} | {_fmt(a.get('train_mem_mb'), ',.0f')} | "
            f"{_fmt(vs.get('memory_x'), '.2f', 'x')} | {_fmt(a.get('final_loss'), '.4f')} | "
            f"{_fmt(a.get('reward_accuracy'), '.2f')} | {status}{note} |"
        )
    lines += [
        "",
        "Where each arm computes DPO's reference: `baseline` once, before the first step (a "
        "no-grad pass over every training and validation pair, stored with the run); the table "
        "shows that pass on its own (warm, and as first run, which also pays the process's "
        'start-up) and charges its warm time to the timed steps pro rata in "tokens/s with '
        "reference pass\". `ref-copy` and `trl-dpo` run a frozen copy's forward inside every "
        "step, the LoRA arms the policy with its adapters off: their tokens/s include it.",
        "",
        "Set on TRL's side to the run's values (the rest is TRL's default):",
        "",
    ]
    lines += footer(doc, ALIGNED, KEPT, png_name, "speed and memory against the baseline")
    return "\n".join(lines) + "\n"


def footer(doc: dict, aligned, kept: str, png_name: str | None, caption: str) -> list[str]:
    """A peer comparison's closing lines: what was aligned on the peer's side and why, what was
    left at its defaults, the versions and commit, and the plot."""
    v = doc["versions"]
    peft = f", peft {v['peft']}" if v.get("peft") else ""
    lines = [f"- {what}: {why}." for what, why in aligned]
    lines += [
        "",
        kept,
        "",
        f"torch {v['torch']}, transformers {v['transformers']}, accelerate "
        f"{v['accelerate']}{peft}, trl {v.get('trl')}, datasets {v.get('datasets')}; python "
        f"{v['python']}. "
        f"Commit {(doc.get('code') or {}).get('commit')}.",
    ]
    if png_name:
        lines += ["", f"![{caption}]({png_name})"]
    return lines
