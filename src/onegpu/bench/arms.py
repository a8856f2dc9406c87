"""The arms of `onegpu bench train`: one row of the guide's table each, plus the peers.

An arm is a few dotted overrides of the baseline run ``Config`` (so a method shows up here as soon
as the config drives it), or a peer trainer given the same run settings: HF ``Trainer`` at its
defaults and with the guide's flags, and TRL's ``SFTTrainer`` at its defaults. With
``training.objective=dpo`` the table is DPO's instead (``dpo_arms``): our DPO, full and LoRA, next
to TRL's ``DPOTrainer`` at its defaults; with ``training.objective=grpo`` (``grpo_arms``), our GRPO
next to TRL's ``GRPOTrainer`` at its defaults; KTO and reward models likewise (``unpaired_arms``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from onegpu.bench.fp8 import fp8_card, planned_overrides
from onegpu.bench.settings import BenchTrainConfig
from onegpu.bench.settle import baseline_compiles
from onegpu.errors import ConfigError

log = logging.getLogger(__name__)

# our train(); transformers.Trainer; TRL's SFTTrainer, DPOTrainer, GRPOTrainer, KTOTrainer,
# RewardTrainer
KINDS = ("onegpu", "hf", "trl", "trl-dpo", "trl-grpo", "trl-kto", "trl-reward")


@dataclass
class Arm:
    name: str
    row: str  # the guide's table row this arm measures
    overrides: dict = field(default_factory=dict)  # dotted Config keys -> values
    kind: str = "onegpu"  # one of KINDS
    # (device, bench cfg, data format) -> the reason it cannot run, or None
    needs: Optional[Callable] = None


# ---------------------------------------------------------------------------------------- checks
FP16_CPU = (
    "fp16 math is emulated on a CPU (many times slower than fp32); measured on CUDA GPUs only"
)


def _cuda_only(reason: str):
    return lambda dev, b, fmt: None if dev.type == "cuda" else reason


def _cuda(what: str):
    return _cuda_only(f"{what} needs a CUDA GPU")


def _ampere(what: str):
    return lambda dev, b, fmt: None if dev.bf16 else f"{what} needs an Ampere-or-newer CUDA GPU"


def _module(mod: str):
    def check(dev, b, fmt):
        import importlib.util

        return None if importlib.util.find_spec(mod) else f"{mod} is not installed"

    return check


def _all(*checks):
    return lambda dev, b, fmt: next((r for r in (c(dev, b, fmt) for c in checks) if r), None)


def _unlike_baseline(precision: str):
    """Skip a precision arm that would repeat the baseline: by default bf16 on a GPU that has it,
    fp16 on an older one, fp32 on a CPU (the same rule as techniques/precision.resolve_precision).
    """

    def check(dev, b, fmt):
        base = b.techniques.precision
        if base == "auto":
            base = ("bf16" if dev.bf16 else "fp16") if dev.type == "cuda" else "fp32"
        return f"the baseline runs {precision} already" if base == precision else None

    return check


def _compiler(dev, b, fmt):
    from onegpu.techniques.compile import has_cpu_compiler

    if dev.type == "cpu" and not has_cpu_compiler():
        return "torch.compile on CPU needs a C++ compiler (g++)"
    return None


def _grpo_compile_device(dev, b, fmt):
    if dev.type != "cpu":
        return "measured on a CPU: gpu-grpo's one 10-minute command holds its two arms"
    return None


def _eager_baseline(dev, b, fmt):
    if baseline_compiles(b, dev.type):
        return "the baseline compiles already (a default run of 50+ steps on this device does)"
    return None


def _compiled_baseline(dev, b, fmt):
    if not baseline_compiles(b, dev.type):
        return "the baseline runs eager already: the compile arm measures compiling here"
    return None


def _trained(dev, b, fmt):
    from onegpu.models import is_preset

    if is_preset(b.model.name) or b.model.from_scratch:
        return (
            "QLoRA quantizes a trained model: give --model.name a saved model directory "
            "(and --model.from_scratch false)"
        )
    return None


def _padded(dev, b, fmt):
    if fmt == "text":
        return "text data is packed into full blocks already: no padding to remove"
    return None


# ------------------------------------------------------------------------------------------ table
def big_micro_batch(b: BenchTrainConfig) -> int:
    """The batch-size arm's micro-batch: the whole effective batch, or under bench.max_micro_batch
    the largest divisor of it that fits (the effective batch stays the same)."""
    eff = b.training.micro_batch_size * b.training.grad_accum
    cap = b.bench.max_micro_batch
    if cap <= 0 or eff <= cap:
        return eff
    return max(d for d in range(1, cap + 1) if eff % d == 0)


def all_arms(b: BenchTrainConfig) -> list[Arm]:
    """The guide's rows, one setting each; the baseline first, the peer trainers last."""
    if b.training.objective == "dpo":
        return dpo_arms()
    if b.training.objective == "grpo":
        return grpo_arms()
    if b.training.objective in ("kto", "reward"):
        return unpaired_arms(b.training.objective)
    eff = b.training.micro_batch_size * b.training.grad_accum
    big = big_micro_batch(b)
    small = max(1, b.training.micro_batch_size // 4)
    mb, ga, prec, opt = (
        "training.micro_batch_size",
        "training.grad_accum",
        "techniques.precision",
        "techniques.optimizer",
    )
    return [
        Arm("baseline", "onegpu baseline", {}),
        Arm("batch-size", "Batch size choice", {mb: big, ga: eff // big}),
        Arm("grad-accum", "Gradient accumulation", {mb: small, ga: eff // small}),
        Arm("checkpointing", "Gradient checkpointing", {"techniques.checkpointing": "full"}),
        Arm("bf16", "Mixed precision (bf16)", {prec: "bf16"}, needs=_unlike_baseline("bf16")),
        Arm("fp16", "Mixed precision (fp16)", {prec: "fp16"},
            needs=_all(_cuda_only(FP16_CPU), _unlike_baseline("fp16"))),
        Arm("tf32", "Mixed precision (tf32)", {"techniques.tf32": True}, needs=_ampere("tf32")),
        # On a GPU the baseline is bf16 already: these two measure what it gains over fp32 and
        # over fp32 with TF32 matmuls (the guide's tf32 row), rather than bf16 against itself.
        Arm("fp32", "Mixed precision (fp32 reference)", {prec: "fp32"},
            needs=_unlike_baseline("fp32")),
        Arm("fp32-tf32", "Mixed precision (tf32, fp32 weights)",
            {prec: "fp32", "techniques.tf32": True}, needs=_ampere("tf32")),
        Arm("flash", "Flash Attention", {"techniques.attention": "flash"},
            needs=_cuda("FlashAttention")),
        Arm("adamw-fused", "Optimizer choice (fused AdamW)", {opt: "adamw-fused"}),
        Arm("adafactor", "Optimizer choice (Adafactor)", {opt: "adafactor"}),
        Arm("adamw-8bit", "Optimizer choice (8-bit AdamW)", {opt: "adamw-8bit"},
            needs=_module("bitsandbytes")),
        Arm("preload", "Data preloading", {"data.num_workers": 2, "data.pin_memory": True}),
        Arm("compile", "torch.compile", {"techniques.compile": "default"},
            needs=_all(_compiler, _eager_baseline)),
        # On a GPU the baseline compiles (settle.settle_compile): this arm shows what that gains.
        Arm("eager", "torch.compile (eager reference)", {"techniques.compile": "off"},
            needs=_compiled_baseline),
        # the planner's layers on this card (bench/fp8.py); compiled, as every onegpu arm on a GPU
        Arm("fp8", "FP8 training (torchao float8, tensorwise)", {}, needs=fp8_card),
        Arm("plain-loss", "Plain cross-entropy (full logits, not fused)",
            {"techniques.loss": "plain"}),
        Arm("padding-free", "Packing instead of padding", {"techniques.padding_free": True},
            needs=_padded),
        Arm("lora", "PEFT (LoRA)", {"techniques.lora.enabled": True}, needs=_module("peft")),
        Arm("qlora", "PEFT (QLoRA, nf4 base)",
            {"techniques.lora.enabled": True, "techniques.lora.quantize_base": "nf4"},
            needs=_all(_module("peft"), _module("bitsandbytes"), _trained)),
        Arm("offload", "DeepSpeed ZeRO (CPU offload)", {"techniques.offload": "zero2-cpu"},
            needs=_cuda("DeepSpeed ZeRO offload in this benchmark")),
        Arm("best", "Best combination", {}),
        Arm("hf-trainer", "HF Trainer, defaults", {}, kind="hf"),
        Arm("hf-trainer-tuned", "HF Trainer, guide's flags", {}, kind="hf"),
        Arm("trl-sft", "TRL SFTTrainer, defaults", {}, kind="trl", needs=_module("trl")),
    ]  # fmt: skip


def dpo_arms() -> list[Arm]:
    """DPO: our defaults (full fine-tune, reference log-probs precomputed once before the first
    step; LoRA, reference = the adapters switched off), our loop with TRL's default full reference
    (a frozen copy run every step) for a like-for-like step, and TRL's DPOTrainer at its defaults,
    full and with the same LoRA adapters (the LoRA arms read r, alpha, dropout and targets from
    techniques.lora)."""
    lora, trl, peft = {"techniques.lora.enabled": True}, _module("trl"), _module("peft")
    return [
        Arm("baseline", "onegpu DPO, full (reference precomputed)", {}),
        Arm("lora", "onegpu DPO, LoRA (reference: adapters off)", lora, needs=peft),
        Arm("ref-copy", "onegpu DPO, full (reference: frozen copy, every step)",
            {"preference.reference": "copy"}),
        Arm("trl-dpo", "TRL DPOTrainer, defaults, full (reference: frozen copy, every step)", {},
            kind="trl-dpo", needs=trl),
        Arm("trl-dpo-lora", "TRL DPOTrainer, defaults, LoRA (reference: adapters off)",
            dict(lora), kind="trl-dpo", needs=_all(trl, peft)),
    ]  # fmt: skip


def grpo_arms() -> list[Arm]:
    """GRPO, full fine-tune: our defaults for the run's settings, and TRL's GRPOTrainer at its
    defaults with the same model, prompts and order, reward functions, groups and sampling."""
    return [
        Arm("baseline", "onegpu GRPO, full fine-tune", {}),
        # what a default run of 50+ steps does: compiled blocks, and the sampler's compiled decode
        # step (a short bench run leaves compile=auto off on a CPU)
        Arm("compile", "onegpu GRPO, compiled (blocks and the sampler's decode step)",
            {"techniques.compile": "default"},
            needs=_all(_grpo_compile_device, _compiler, _eager_baseline)),
        Arm("trl-grpo", "TRL GRPOTrainer, defaults, full fine-tune", {}, kind="trl-grpo",
            needs=_module("trl")),
    ]  # fmt: skip


def unpaired_arms(objective: str) -> list[Arm]:
    """KTO or a reward model: ours, full and LoRA, next to TRL's KTOTrainer / RewardTrainer at its
    defaults, full and LoRA (KTO's reference, full: ours precomputed, TRL's a copy every step)."""
    peer, lora = f"trl-{objective}", {"techniques.lora.enabled": True}
    what, trainer = {"kto": ("KTO", "KTOTrainer")}.get(objective, ("reward model", "RewardTrainer"))
    return [
        Arm("baseline", f"onegpu {what}, full", {}),
        Arm("lora", f"onegpu {what}, LoRA", lora, needs=_module("peft")),
        # a reward model's shared prompt off (techniques.shared_prompt is the reward model's)
        *([Arm("two-rows", f"onegpu {what}, full, two rows a pair",
               {"techniques.shared_prompt": "off"})] if objective == "reward" else []),
        # checkpointing on, as TRL's trainers have it by default: the like-for-like memory
        Arm("checkpointing", f"onegpu {what}, full, checkpointing",
            {"techniques.checkpointing": "full"}),
        Arm(peer, f"TRL {trainer}, defaults, full", {}, kind=peer, needs=_module("trl")),
        Arm(f"{peer}-lora", f"TRL {trainer}, defaults, LoRA", dict(lora), kind=peer,
            needs=_all(_module("trl"), _module("peft"))),
    ]  # fmt: skip


BEST = {
    "cpu": ["batch-size", "adamw-fused", "compile"],
    "cuda": ["batch-size", "bf16", "tf32", "flash", "adamw-fused", "compile"],
}


def select_arms(b: BenchTrainConfig, device, fmt: str = "text") -> list[Arm]:
    arms = {a.name: a for a in all_arms(b)}
    chosen = [arms[n] for n in arm_names(b)]
    for arm in chosen:
        if arm.name == "best":
            arm.overrides = best_overrides(b, device, arms, fmt)
        if arm.name == "fp8":
            arm.overrides = planned_overrides(b, device)
    return chosen


def arm_names(b: BenchTrainConfig) -> list[str]:
    """The arms asked for, baseline first; an unknown name is an error with a did-you-mean."""
    known = [a.name for a in all_arms(b)]
    names = (
        known
        if b.bench.arms.strip() == "all"
        else [n.strip() for n in b.bench.arms.split(",") if n.strip()]
    )
    best = (
        [] if b.bench.best == "auto" else [n.strip() for n in b.bench.best.split(",") if n.strip()]
    )
    for field_name, values in (("arms", names), ("best", best)):
        for n in values:
            if n not in known:
                import difflib

                close = difflib.get_close_matches(n, known, n=1)
                raise ConfigError(
                    f"bench.{field_name}: unknown arm '{n}'.",
                    hint=f"did you mean '{close[0]}'?"
                    if close
                    else f"choose from: {', '.join(known)}",
                )
    return ["baseline"] + [n for n in dict.fromkeys(names) if n != "baseline"]


def best_overrides(b: BenchTrainConfig, device, arms: dict, fmt: str) -> dict:
    """The recommended methods merged; those this device cannot run are left out (and logged)."""
    names = (
        BEST.get(device.type, BEST["cpu"])
        if b.bench.best == "auto"
        else [n.strip() for n in b.bench.best.split(",")]
    )
    merged = {}
    for n in names:
        if n not in arms or arms[n].kind != "onegpu" or n in ("best", "baseline"):
            raise ConfigError(
                f"bench.best: '{n}' is not a onegpu method arm.",
                hint="list method arms, e.g. batch-size,adamw-fused",
            )
        reason = skip_reason(arms[n], device, b, fmt)
        if reason:
            log.info("best: leaving out %s (%s)", n, reason)
            continue
        merged.update(arms[n].overrides)
    return merged


def skip_reason(arm: Arm, device, b: BenchTrainConfig, fmt: str) -> Optional[str]:
    """Why an arm cannot run here (None: it can). Runnable-but-slow arms (bf16 on CPU) still run."""
    if arm.needs is not None:
        return arm.needs(device, b, fmt)
    return None
