"""What every page of `onegpu bench train` shares: its opening (title, the provenance header, the
setup paragraph), the headline pairing our arms with a peer trainer (which side compiled, what
each side's start-up cost), a table, the notes read off an arm's evidence, and the closing lines."""

from __future__ import annotations

from onegpu.bench import provenance
from onegpu.bench.timing import fmt as _fmt

# Arms compared with the peer trainers in the headline. Trainer's default optimizer is fused
# AdamW (torch >= 2.8), so "adamw-fused" is our loop with the same settings.
VS_HF = ("baseline", "adamw-fused", "best", "fp8")
# The peers: document key -> (peer arm, how the headline names it, our arms compared with it).
PEERS = {
    "vs_hf_trainer": ("hf-trainer", "HF Trainer (defaults)", VS_HF),
    "vs_hf_trainer_tuned": ("hf-trainer-tuned", "HF Trainer (guide's flags)", VS_HF),
    "vs_trl_sft": ("trl-sft", "TRL SFTTrainer (defaults)", VS_HF),
    # DPO: full against full (our precomputed reference, and our loop with TRL's copy), LoRA against
    # LoRA
    "vs_trl_dpo": ("trl-dpo", "TRL DPOTrainer (defaults)", ("baseline", "ref-copy")),
    "vs_trl_dpo_lora": ("trl-dpo-lora", "TRL DPOTrainer with LoRA (defaults)", ("lora",)),
    # GRPO: our defaults against TRL's (train_grpo_report adds generation, training and reward)
    "vs_trl_grpo": ("trl-grpo", "TRL GRPOTrainer (defaults)", ("baseline", "compile")),
    # KTO and reward models: full against full, LoRA against LoRA
    "vs_trl_kto": ("trl-kto", "TRL KTOTrainer (defaults)", ("baseline",)),
    "vs_trl_kto_lora": ("trl-kto-lora", "TRL KTOTrainer with LoRA (defaults)", ("lora",)),
    "vs_trl_reward": ("trl-reward", "TRL RewardTrainer (defaults)", ("baseline",)),
    "vs_trl_reward_lora": ("trl-reward-lora", "TRL RewardTrainer with LoRA (defaults)", ("lora",)),
}


def evidence(arm: dict) -> dict:
    """The first repetition's evidence (facts read off the arm's live objects), or {}."""
    return next((r["evidence"] for r in arm.get("reps", []) if r.get("evidence")), None) or {}


def compiled(arm: dict) -> bool | None:
    """Whether the arm's code was compiled, read off its live objects (the evidence)."""
    ev = evidence(arm)
    return None if "compiled" not in ev else bool(ev["compiled"])


def side(arm: dict) -> str:
    """'compiled' or 'eager', as the headline says it."""
    return {True: "compiled", False: "eager", None: "compile unknown"}[compiled(arm)]


def opening(doc: dict, title: str, setup: str) -> list[str]:
    """The title, the results header (provenance.py: command, commit, date, machine, load) and the
    paragraph saying what was run."""
    return [f"# {title}", "", provenance.markdown(doc), setup, ""]


def headline(doc: dict, peers: dict) -> list[str]:
    """One line per pairing with a peer: the ratios (with a precomputed reference's pass charged
    too, where an arm has one), which side compiled, and each side's start-up seconds (compiling
    included) beside the steady tokens/s the ratio compares. ``peers``: PEERS, or some of them."""
    lines = []
    for key, (ref, label, *_ours) in peers.items():
        peer = doc["arms"].get(ref, {})
        for name, vs in doc.get(key, {}).items():
            ours = doc["arms"][name]
            unlike = compiled(ours) is not None and compiled(ours) != compiled(peer)
            with_ref = ""
            if ours.get("reference_pass_s") is not None:
                with_ref = (
                    f" ({_fmt(vs.get('speed_x_with_ref'), '.2f', 'x')} with its reference pass)"
                )
            lines.append(
                f"- **onegpu `{name}` ({side(ours)}) vs {label} ({side(peer)}): "
                f"{_fmt(vs['speed_x'], '.2f', 'x')} tokens/s{with_ref}, "
                f"{_fmt(vs['memory_x'], '.2f', 'x')} memory.** Start-up "
                f"{_fmt(ours.get('startup_s'), '.0f', ' s')} vs "
                f"{_fmt(peer.get('startup_s'), '.0f', ' s')}"
                + ("; not like for like: only one side compiled." if unlike else ".")
            )
    return lines + ([""] if lines else [])


def table(header: str, rows: list[list[str]]) -> list[str]:
    """A markdown table: ``header`` its column names joined by " | ", one line per row."""
    n = header.count(" | ") + 1
    return [f"| {header} |", "|" + "---|" * n] + ["| " + " | ".join(r) + " |" for r in rows]


def status(arm: dict) -> str:
    """ "**failed** " or "**skipped** " before an arm's note; "" for one that ran."""
    return "" if arm["status"] == "ok" else f"**{arm['status']}** "


def notes(arm: dict, *extra: str | None) -> str:
    """The precision and checkpointing the arm's evidence shows, then ``extra``."""
    ev = evidence(arm)
    bits = [ev.get("precision"), "checkpointing" if ev.get("checkpointing") else None, *extra]
    return ", ".join(b for b in bits if b)


def compile_note(doc: dict) -> str:
    """How compile=auto was settled for our arms on this device (bench.arms.settle_compile)."""
    steps = doc["config"]["training"]["max_steps"]
    if doc["device"]["type"] == "cuda":
        return (
            "Compile: on a GPU our arms run as a default run of 50+ steps does (compile=auto "
            "compiles there), though this one has "
            f"{steps}; compiling falls in the untimed first steps and shows as start-up seconds."
        )
    return (
        f"Compile: on a CPU compile=auto decides by the run's own length ({steps} steps: "
        + (
            "compiled where a C++ compiler exists"
            if steps >= 50
            else "eager, as `onegpu train` runs under 50 steps"
        )
        + "); the `compile` arm shows what compiling adds."
    )


def footer(doc: dict, aligned, kept: str, png_name: str | None, caption: str) -> list[str]:
    """A page's closing lines: what was aligned on the peer's side and why, what was left at its
    defaults (none of either on the methods' page), the versions and the plot."""
    v = doc["versions"]
    peft = f", peft {v['peft']}" if v.get("peft") else ""
    lines = [f"- {what}: {why}." for what, why in aligned] + ["", kept] if kept else []
    lines += [
        "",
        f"torch {v['torch']}, transformers {v['transformers']}, accelerate "
        f"{v['accelerate']}{peft}, bitsandbytes {v.get('bitsandbytes')}, trl {v.get('trl')}, "
        f"datasets {v.get('datasets')}; python {v['python']}.",
    ]
    return lines + (["", f"![{caption}]({png_name})"] if png_name else [])
