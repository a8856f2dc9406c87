"""The markdown of `onegpu bench train --objective dpo|kto|reward`: onegpu's DPO, KTO or reward
model next to TRL's DPOTrainer, KTOTrainer or RewardTrainer.

The numbers are train_report.summarize's (medians over interleaved rounds, ratios paired per round
with the TRL arm of the same kind: full with full, LoRA with LoRA). This page says which arm
computes its reference where, so a precomputed reference (DPO's, KTO's) is never read as free: its
pass is shown on its own and charged in a column of its own.
"""

from __future__ import annotations

from onegpu.bench.timing import fmt as _fmt
from onegpu.bench.train_headline import (
    PEERS,
    evidence,
    footer,
    headline,
    notes,
    opening,
    status,
    table,
)

COMMON = [
    ("model", "the same seeded weights, built in the arm's process"),
    (
        "steps, micro-batch x accumulation",
        "the same examples per step; tokens/s counts the same real tokens",
    ),
    (
        "precision",
        "TRL defaults to bf16 autocast; set to the run's (fp32 on a CPU, bf16 on the GPU presets)",
    ),
    (
        "learning rate and schedule",
        "lr, cosine to the same floor, no warm-up, weight decay, Adam beta2, clipping, seed",
    ),
    ("LoRA (LoRA arms)", "the same adapters: r, alpha, dropout, target modules"),
]
ALIGNED = {
    "dpo": [
        (
            "pairs and their order",
            "the records our data code makes (`pairs.corpus_pairs`), in the order our loop draws "
            "them; TRL tokenizes them itself and the bench checks its ids equal ours pair by pair",
        ),
        ("max length", "`max_length` = data.seq_len (TRL's default 1024); no pair here reaches it"),
        ("beta, label smoothing", "the loss itself (TRL's defaults 0.1 and 0 equal ours)"),
    ],
    "kto": [
        (
            "examples and their order",
            "the records our data code makes (each standard-library pair's chosen side a "
            "desirable example, its rejected side an undesirable one), in the order our loop "
            "draws them (TRL's sequential sampler, which its KL estimate requires); TRL tokenizes "
            "them itself and the bench checks its prompt and completion ids equal ours",
        ),
        ("max length", "`max_length` = data.seq_len (TRL's default 1024); no example reaches it"),
        (
            "beta, desirable and undesirable weights",
            "the loss itself (TRL's defaults 0.1, 1 and 1 equal ours)",
        ),
    ],
    "reward": [
        (
            "pairs and their order",
            "the records our data code makes (`pairs.corpus_pairs`), in the order our loop draws "
            "them; TRL tokenizes them itself (prompt and response as one text) and the bench "
            "checks each chosen and rejected sequence equals ours",
        ),
        ("max length", "`max_length` = data.seq_len (TRL's default 1024); no pair reaches it"),
        ("center_rewards_coefficient", "the loss itself (TRL's default None equals ours)"),
    ],
}
KEPT = {
    "dpo": (
        "TRL's own defaults kept: its reference (a frozen copy of the model run inside every step "
        "for a full fine-tune; the adapters switched off for LoRA), gradient checkpointing on, "
        "padding to the longest sequence (ours: to a multiple of 64), its metrics every step, "
        "Trainer's fused AdamW."
    ),
    "kto": (
        "TRL's own defaults kept: its reference (a frozen copy of the model run inside every step "
        "for a full fine-tune; the adapters switched off for LoRA), its KL estimate (a no-grad "
        "forward over each batch's completions shifted by one, as ours over the split's), gradient "
        "checkpointing on, padding to the longest sequence (ours: to a multiple of 64), its "
        "metrics every step, Trainer's fused AdamW."
    ),
    "reward": (
        "TRL's own defaults kept: the score head as transformers initialises it (ours too), "
        "gradient checkpointing on, padding to the longest sequence (ours: to a multiple of 64), "
        "its metrics every step, Trainer's fused AdamW; with LoRA the score head trains whole "
        "(PEFT's SEQ_CLS task), as ours."
    ),
}
TITLE = {
    "dpo": ("DPO", "DPOTrainer"),
    "kto": ("KTO", "KTOTrainer"),
    "reward": ("Reward model", "RewardTrainer"),
}
# Where each arm computes the reference, or what accuracy means, after the table.
CLOSING = {
    "dpo": "Where each arm computes DPO's reference: `baseline` once, before the first step (a "
    "no-grad pass over every training and validation pair, stored with the run); the table shows "
    "that pass on its own (warm, and as first run, which also pays the process's start-up) and "
    'charges its warm time to the timed steps pro rata in "tokens/s with reference pass". '
    "`ref-copy` and `trl-dpo` run a frozen copy's forward inside every step, the LoRA arms the "
    "policy with its adapters off: their tokens/s include it. Accuracy: the share of pairs whose "
    "implicit reward ranks chosen above rejected (TRL's rewards/accuracies).",
    "kto": "Where each arm computes KTO's reference: `baseline` once, before the first step (a "
    "no-grad pass over every example and its mismatched sequence, stored with the run); the table "
    "shows that pass on its own (warm, and as first run, which also pays the process's start-up) "
    'and charges its warm time to the timed steps pro rata in "tokens/s with reference pass". '
    "`trl-kto` runs a frozen copy's forward inside every step, the LoRA arms the policy with its "
    "adapters off: their tokens/s include it. Accuracy: the share of examples on their label's "
    "side of the reference point (ours); TRL logs no such figure.",
    "reward": "Accuracy: the share of the last logged window's pairs scored chosen above rejected "
    "(both sides log it).",
}


def _vs_peer(doc: dict, name: str, objective: str) -> dict:
    """This arm's ratios against its TRL counterpart; 1.00 for the peers."""
    for key in (f"vs_trl_{objective}", f"vs_trl_{objective}_lora"):
        if name in doc.get(key, {}):
            return doc[key][name]
    if name.startswith("trl-") and doc["arms"][name].get("tokens_per_s"):
        return {"speed_x": 1.0, "memory_x": 1.0, "speed_x_with_ref": 1.0}
    return {}


def _note(arm: dict) -> str:
    ev = evidence(arm)
    bits = []
    if ev.get("trainable_params") and ev.get("total_params"):
        bits.append(f"{ev['trainable_params'] / ev['total_params']:.0%} of weights train")
    if str(arm.get("kind", "")).startswith("trl-"):
        bits.append(f"TRL {ev.get('trl')}")
        if ev.get("reference"):
            bits.append(f"reference: {ev['reference']}")
    return notes(arm, *bits)


def preference_markdown(doc: dict, png_name: str | None = None) -> str:
    c, s, d = doc["config"], doc["setup"], doc["device"]
    t, b = c["training"], c["bench"]
    objective = t["objective"]
    what, trainer = TITLE[objective]
    unit = "examples" if objective == "kto" else "pairs"
    counted = (
        "each example's prompt + completion (the mismatched sequences of the KL estimate, a "
        "no-grad forward on both sides, are not counted)"
        if objective == "kto"
        else "the chosen and rejected sequences (prompt + response, both)"
    )
    reps = [r for a in doc["arms"].values() for r in a.get("reps", [])]
    mem = next((r["memory_kind"] for r in reps if r.get("memory_kind")), "peak memory")
    threads = sorted({r["torch_threads"] for r in reps if r.get("torch_threads")})
    setup = (
        f"Model `{s['model_name']}` ({s['params'] / 1e6:.2f} M parameters), "
        f"{s['train_examples']} {unit} from the standard library's preference pairs, "
        f"{t['micro_batch_size'] * t['grad_accum']} {unit} a step ({t['micro_batch_size']} x "
        f"{t['grad_accum']}), sequences of at most {c['data']['seq_len']} tokens, "
        f"{t['max_steps']} steps per arm (first {b['warmup_steps']} untimed), {b['reps']} "
        f"interleaved rounds; medians, and the range over rounds. tokens/s counts the real tokens "
        f"of {counted}, the same count in every arm. Memory: what training added to the process "
        f"({mem}). Torch threads per arm: {', '.join(map(str, threads)) or '—'}. Ratios pair "
        "each round's arm with that round's TRL arm of the same kind."
    )
    peers = {k: PEERS[k] for k in (f"vs_trl_{objective}", f"vs_trl_{objective}_lora")}
    lines = opening(doc, f"{what} on {d['name']}: onegpu and TRL's {trainer}", setup)
    lines += headline(doc, peers)
    rows = []
    for name, a in doc["arms"].items():
        vs = _vs_peer(doc, name, objective)
        rng = a.get("tokens_per_s_range")
        if a.get("reference_pass_s") is not None:
            ref = (
                f"{_fmt(a.get('reference_pass_warm_s'), '.2f')} / "
                f"{_fmt(a.get('reference_pass_s'), '.2f')}"
            )
        else:
            ref = "none" if objective == "reward" else "in every step"
        rows.append(
            [name, a["row"], _fmt(a.get("tokens_per_s"), ",.0f")]
            + ["—" if not rng else f"{rng[0]:,.0f}–{rng[1]:,.0f}"]
            + [ref if a["status"] == "ok" else "—", _fmt(a.get("tokens_per_s_with_ref"), ",.0f")]
            + [_fmt(vs.get("speed_x"), ".2f", "x"), _fmt(a.get("train_mem_mb"), ",.0f")]
            + [_fmt(vs.get("memory_x"), ".2f", "x"), _fmt(a.get("final_loss"), ".4f")]
            + [_fmt(a.get("reward_accuracy"), ".2f")]
            + [status(a) + (a.get("reason") or a.get("inactive") or _note(a))]
        )
    lines += table(
        "arm | trainer | tokens/s | range | reference pass s (warm / first) | tokens/s with "
        "reference pass | speed x TRL | train mem MB | memory x TRL | final loss | accuracy | note",
        rows,
    )
    lines += ["", CLOSING[objective], ""]
    lines += ["Set on TRL's side to the run's values (the rest is TRL's default):", ""]
    lines += footer(
        doc,
        ALIGNED[objective] + COMMON,
        KEPT[objective],
        png_name,
        "speed and memory against the baseline",
    )
    return "\n".join(lines) + "\n"
