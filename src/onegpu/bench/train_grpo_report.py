"""The results of `onegpu bench train --objective grpo`: onegpu's GRPO next to TRL's GRPOTrainer.

Per arm, the medians over interleaved rounds (and their range) of whole-step tokens/s (generation
plus training), generation and training apart, peak memory, and the reward per step (the reward
curve: the median over rounds at each step, with the rounds' range). Ratios pair each round's arm
with that round's TRL arm (train_report.paired_ratio). Each round has its own seed, the same for
both arms, so the spread over rounds is the reward's noise.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from onegpu.bench.timing import fmt as _fmt
from onegpu.bench.timing import median as _median
from onegpu.bench.timing import span as _span
from onegpu.bench.train_headline import evidence, footer, notes, opening, status, table

PEER = "trl-grpo"
TAIL = 5  # steps averaged into the "final reward" (one step's reward is noisy)

# What the bench sets on TRL's side to our run's values, and why (train_peers.hf_arguments,
# train_grpo.aligned_arguments); everything else is TRL's default.
ALIGNED = [
    ("model", "the same saved model (the same `final/` folder), fp32 weights"),
    (
        "prompts and their order",
        "the records our data code makes, in the order our loop draws them, handed over in that "
        "order with `shuffle_dataset=False` (TRL shuffles by default); TRL tokenizes them itself "
        "and the bench checks the prompt ids its `generate` received equal ours, row by row",
    ),
    (
        "reward functions",
        "the same function objects (`onegpu.objectives.rewards`, TRL's signature) and weights",
    ),
    (
        "groups and sampling",
        "`num_generations` = grpo.group_size, `max_completion_length`, temperature, top_p, top_k",
    ),
    (
        "steps, batch x accumulation",
        "`per_device_train_batch_size` and accumulation = ours: the same completions per step "
        "(TRL's generation batch is one step's)",
    ),
    (
        "learning rate and schedule",
        "lr, cosine to the same floor, no warm-up, weight decay, Adam beta2, clipping, seed (TRL's "
        "default lr 1e-6 would make the reward curves incomparable)",
    ),
    (
        "the objective",
        "loss_type, beta, epsilon (low and high), scale_rewards, num_iterations, masking of "
        "truncated completions: set explicitly, equal to TRL's defaults (ours are TRL's)",
    ),
    ("precision", "fp32 on a CPU (`use_cpu=True`, `bf16=False`; TRL's default is bf16)"),
    ("logging", "`logging_steps=1`: the reward of every step, as our arm logs it"),
]
KEPT = (
    "TRL's own defaults kept: gradient checkpointing on, rollouts by the model's plain `generate` "
    "(no vLLM, no continuous batching), its fused LM head for the per-token log-probs "
    "(`fused_lm_head`), Trainer's default optimizer (named in the json's evidence)."
)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize_grpo(doc: dict) -> dict:
    """Per arm: generation and training figures, memory, the reward curve and its first and last
    steps, and whether its final reward is within TRL's noise (train_report.summarize then pairs
    the ratios against TRL, GRPO_RATIOS)."""
    for arm in doc["arms"].values():
        ok = [r for r in arm["reps"] if r.get("status") == "ok" and r.get("timed_seconds", 0) > 0]
        for r in ok:
            n = max(r["timed_steps"], 1)
            r["gen_s_per_step"] = r.get("gen_seconds", 0.0) / n
            r["train_s_per_step"] = r.get("train_seconds", 0.0) / n
            rewards = [s.get("reward") for s in r.get("steps", [])]
            r["reward_first"] = _mean(rewards[:TAIL])
            r["reward_last"] = _mean(rewards[-TAIL:])
        for key in (
            "gen_tokens_per_s",
            "train_tokens_per_s",
            "gen_s_per_step",
            "train_s_per_step",
            "reward_first",
            "reward_last",
        ):
            arm[key] = _median([r.get(key) for r in ok])
            arm[f"{key}_range"] = _span([r.get(key) for r in ok])
        arm["train_mem_mb_range"] = _span([r.get("train_mem_mb") for r in ok])
        arm["reward_curve"] = curve(ok)
    peer = doc["arms"].get(PEER, {})
    for name, arm in doc["arms"].items():
        if name != PEER:
            arm["reward_within_noise"] = within_noise(arm, peer)
    return doc


# ratio key in doc["vs_trl_grpo"][arm] -> the per-round figure it pairs (besides speed and memory)
GRPO_RATIOS = {
    "gen_x": "gen_tokens_per_s",
    "train_x": "train_tokens_per_s",
    "reward_last_x": "reward_last",
}


def curve(reps: list[dict]) -> list[dict]:
    """Per step: the median reward over rounds and the rounds' lowest and highest."""
    by_step: dict[int, list[float]] = {}
    for r in reps:
        for s in r.get("steps", []):
            if s.get("reward") is not None:
                by_step.setdefault(s["step"], []).append(s["reward"])
    return [
        {"step": k, "median": statistics.median(v), "low": min(v), "high": max(v)}
        for k, v in sorted(by_step.items())
    ]


def within_noise(arm: dict, peer: dict):
    """Whether each arm's median final reward lies within the other's range over rounds (None
    without both)."""
    a, b = arm.get("reward_last_range"), peer.get("reward_last_range")
    if not a or not b:
        return None
    return b[0] <= arm["reward_last"] <= b[1] and a[0] <= peer["reward_last"] <= a[1]


# ----------------------------------------------------------------------------------------- output
def _rng(r, spec: str) -> str:
    return "—" if not r else f"{r[0]:{spec}}–{r[1]:{spec}}"


def _note(arm: dict, doc: dict) -> str:
    ev = evidence(arm)
    if arm.get("kind") == PEER:
        bits = [f"TRL {ev.get('trl')}", ev.get("generation"), f"loss {ev.get('loss_type')}"]
        bits.append("same prompt ids" if ev.get("same_tokens") else None)
    else:
        bits = [f"sampler {doc['config']['grpo'].get('sampler', 'generate')}"]
        bits.append("compiled" if ev.get("compiled") else None)
    steps = doc["config"]["training"]["max_steps"]
    for r in arm.get("reps", []):  # an arm that ran out of bench.max_seconds: fewer steps
        if r.get("status") == "ok" and r.get("steps_done", steps) < steps:
            bits.append(f"round {r['rep']}: {r['steps_done']} of {steps} steps (time budget)")
    return notes(arm, *bits)


def grpo_markdown(doc: dict, png_name: str | None = None) -> str:
    c, s, d = doc["config"], doc["setup"], doc["device"]
    t, b, g = c["training"], c["bench"], c["grpo"]
    per_step = t["micro_batch_size"] * t["grad_accum"]
    mem = next(
        (r.get("memory_kind") for a in doc["arms"].values() for r in a.get("reps", [])),
        "peak memory",
    )
    setup = (
        f"Model `{s['model_name']}` ({s['params'] / 1e6:.2f} M parameters); "
        f"{per_step // g['group_size']} prompts x {g['group_size']} completions a step "
        f"({t['micro_batch_size']} x {t['grad_accum']}), completions of at most "
        f"{g['max_completion_length']} tokens, prompts of at most {c['data']['seq_len']}, reward "
        f"`{', '.join(g['rewards']) or 'python_continues'}`, "
        f"loss {g['loss_type']}, beta {g['beta']}, lr {t['lr']}; {t['max_steps']} steps per arm "
        f"(first {b['warmup_steps']} untimed), {b['reps']} interleaved rounds, round k with seed "
        f"{t['seed']}+k for both arms; medians, and the range over rounds. Tokens: the real prompt "
        "+ completion tokens of the step's completions, the same count in both arms. Generation: "
        "the time inside `generate`; training: the rest of the step (scoring, the loss's forward "
        f"and backward, the optimizer). Memory: what training added to the process ({mem}). "
        "Ratios pair each round's arm with that round's TRL arm. The load at the start of each "
        "arm's run: the json's schedule."
    )
    lines = opening(doc, f"GRPO on {d['name']}: onegpu and TRL's GRPOTrainer", setup)
    noise = {True: "within", False: "not within", None: "no"}
    for name, vs in doc.get("vs_trl_grpo", {}).items():
        lines.append(
            f"- **onegpu `{name}` / TRL GRPOTrainer (defaults): {_fmt(vs['speed_x'], '.2f', 'x')} "
            f"whole-step tokens/s, {_fmt(vs.get('gen_x'), '.2f', 'x')} generation tokens/s, "
            f"{_fmt(vs.get('train_x'), '.2f', 'x')} training tokens/s, "
            f"{_fmt(vs['memory_x'], '.2f', 'x')} peak memory added, "
            f"{_fmt(vs.get('reward_last_x'), '.2f', 'x')} final reward (mean of the last {TAIL} "
            f"steps; {noise[doc['arms'][name].get('reward_within_noise')]} each other's range "
            "over rounds).**"
        )
    rows = []
    for name, a in doc["arms"].items():
        rows.append([name, a["row"]])
        for key in ("tokens_per_s", "gen_tokens_per_s", "train_tokens_per_s"):
            rows[-1] += [_fmt(a.get(key), ",.0f"), _rng(a.get(f"{key}_range"), ",.0f")]
        rows[-1] += [_fmt(a.get("gen_s_per_step"), ".2f"), _fmt(a.get("train_s_per_step"), ".2f")]
        rows[-1] += [_fmt(a.get("train_mem_mb"), ",.0f"), _rng(a.get("train_mem_mb_range"), ",.0f")]
        rows[-1] += [_fmt(a.get("reward_first"), ".3f"), _fmt(a.get("reward_last"), ".3f")]
        rows[-1] += [_rng(a.get("reward_last_range"), ".3f")]
        rows[-1] += [status(a) + (a.get("reason") or _note(a, doc))]
    lines += [""] + table(
        "arm | trainer | whole-step tokens/s | range | generation tokens/s | range | training "
        "tokens/s | range | gen s / step | train s / step | train mem MB | range | reward, first "
        f"{TAIL} steps | reward, last {TAIL} steps | range | note",
        rows,
    )
    lines += reward_table(doc)
    lines += ["", "Set on TRL's side to the run's values (the rest is TRL's default):", ""]
    lines += footer(doc, ALIGNED, KEPT, png_name, "reward curves, speed and memory")
    return "\n".join(lines) + "\n"


def reward_table(doc: dict, every: int = 5) -> list[str]:
    """The reward curve as a table: the median over rounds (and range) every ``every`` steps."""
    arms = [n for n, a in doc["arms"].items() if a.get("reward_curve")]
    if not arms:
        return []
    steps = sorted({p["step"] for n in arms for p in doc["arms"][n]["reward_curve"]})
    shown = [k for k in steps if k == steps[0] or k % every == 0 or k == steps[-1]]
    out = [
        "",
        "Reward per step (median over rounds, range in brackets):",
        "",
    ]
    rows = []
    for k in shown:
        rows.append([str(k)])
        for n in arms:
            p = next((p for p in doc["arms"][n]["reward_curve"] if p["step"] == k), None)
            rows[-1].append(
                "—" if p is None else f"{p['median']:.3f} [{p['low']:.3f}–{p['high']:.3f}]"
            )
    return out + table("step | " + " | ".join(arms), rows)


def chart(doc: dict, path: Path) -> Path:
    """The reward curves (median over rounds, the rounds' range shaded), and whole-step,
    generation and training tokens/s and memory of each arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=100)
    colors = {"baseline": "#4c72b0", PEER: "#dd8452"}
    for name, a in doc["arms"].items():
        pts = a.get("reward_curve") or []
        if not pts:
            continue
        x = [p["step"] for p in pts]
        col = colors.get(name, "#55a868")
        ax.plot(x, [p["median"] for p in pts], color=col, label=f"{name} ({a['row']})")
        ax.fill_between(x, [p["low"] for p in pts], [p["high"] for p in pts], color=col, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean over the step's completions)")
    ax.set_title("reward curve: median over rounds, range shaded")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    keys = [
        ("tokens_per_s", "whole-step tok/s"),
        ("gen_tokens_per_s", "generation tok/s"),
        ("train_tokens_per_s", "training tok/s"),
        ("train_mem_mb", "train mem MB"),
    ]
    names = [n for n, a in doc["arms"].items() if a.get("tokens_per_s")]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        a, peer = doc["arms"][name], doc["arms"].get(PEER, {})
        vals = [(a.get(k) or 0.0) / (peer.get(k) or a.get(k) or 1.0) for k, _ in keys]
        bx.bar(
            [j + i * width for j in range(len(keys))],
            vals,
            width,
            color=colors.get(name, "#55a868"),
            label=name,
        )
    bx.axhline(1.0, color="black", lw=0.8)
    bx.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))])
    bx.set_xticklabels([label for _, label in keys], fontsize=8)
    bx.set_title("x TRL GRPOTrainer (medians)")
    bx.grid(axis="y", alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(f"onegpu bench train --objective grpo — {doc['device']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
