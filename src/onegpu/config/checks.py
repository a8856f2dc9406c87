"""Checks of a whole configuration that its types cannot express: ranges, and switches that
conflict."""

from __future__ import annotations

import dataclasses
from typing import Any

from onegpu.config.grpo import check_grpo
from onegpu.config.sections import Config
from onegpu.errors import ConfigError

POSITIVE_INTS = {
    "data.seq_len",
    "data.edit_max_chars",
    "data.num_proc",
    "data.prefetch_factor",
    "data.pad_to_multiple",
    "model.vocab_size",
    "training.micro_batch_size",
    "training.grad_accum",
    "training.max_steps",
    "training.log_every",
    "techniques.checkpointing_every",
    "techniques.lora.r",
    "output.keep_last",
    "techniques.tiled_mlp_min_seq",
}
NON_NEGATIVE = {
    "data.max_bytes",
    "data.num_workers",
    "data.max_pixels",
    "data.min_pixels",
    "data.image_size",
    "training.max_minutes",
    "training.lr",
    "training.warmup_steps",
    "training.weight_decay",
    "training.max_grad_norm",
    "training.eval_every",
    "training.eval_batches",
    "training.save_every",
    "techniques.loss_chunk_size",
    "techniques.lora.dropout",
    "training.max_bad_steps",
    "techniques.activation_offload_min_bytes",
    "techniques.tiled_mlp_tile_tokens",
}
# Optimizers DeepSpeed offload can replace with its own CPU Adam; the others keep state it cannot
# move.
OFFLOAD_OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused")


def validate(cfg: Config) -> Config:
    """Check values the types cannot express; raise one ConfigError naming the field and the fix."""
    flat = dataclasses.asdict(cfg)
    for key in sorted(POSITIVE_INTS):
        if _get(flat, key) <= 0:
            raise ConfigError(
                f"{key} must be a positive integer, got {_get(flat, key)}.", hint=f"set {key} >= 1"
            )
    for key in sorted(NON_NEGATIVE):  # "auto" is settled to a number by hyper.py, and checked then
        if _get(flat, key) != "auto" and _get(flat, key) < 0:
            raise ConfigError(
                f"{key} must not be negative, got {_get(flat, key)}.", hint=f"set {key} >= 0"
            )
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}.",
            hint="set data.val_fraction to e.g. 0.05 (0 = no validation)",
        )
    if not 0.0 <= cfg.training.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"training.min_lr_ratio must be in [0, 1], got {cfg.training.min_lr_ratio}.",
            hint="set training.min_lr_ratio to e.g. 0.1",
        )
    if cfg.distributed.zero_stage not in (1, 2, 3):
        raise ConfigError(
            f"distributed.zero_stage must be 1, 2 or 3, got {cfg.distributed.zero_stage}.",
            hint="set distributed.zero_stage to 1, 2 or 3",
        )
    _check_conflicts(cfg)
    _check_preference(cfg)
    check_grpo(cfg)
    return cfg


def _check_conflicts(cfg: Config) -> None:
    """Combinations that each make sense alone but not together."""
    tech, out = cfg.techniques, cfg.output
    if tech.offload != "none" and tech.optimizer not in OFFLOAD_OPTIMIZERS:
        raise ConfigError(
            f"techniques.offload={tech.offload} cannot be combined with techniques.optimizer="
            f"{tech.optimizer}: DeepSpeed offload runs its own CPU AdamW.",
            hint="set techniques.optimizer=adamw, or techniques.offload=none",
        )
    if tech.lora.quantize_base != "none" and not tech.lora.enabled:
        raise ConfigError(
            f"techniques.lora.quantize_base={tech.lora.quantize_base} needs LoRA: a quantized base "
            "cannot be trained directly.",
            hint="add --techniques.lora.enabled true",
        )
    if tech.loss == "plain" and tech.loss_chunk_size:
        raise ConfigError(
            f"techniques.loss_chunk_size={tech.loss_chunk_size} sets the fused loss's chunks, but "
            "techniques.loss=plain.",
            hint="drop techniques.loss_chunk_size, or set techniques.loss=fused",
        )
    if tech.activation_offload and tech.checkpointing == "offload":
        raise ConfigError(
            "techniques.activation_offload and techniques.checkpointing=offload both send the "
            "checkpointed layer inputs to host memory.",
            hint="use techniques.checkpointing=full with techniques.activation_offload (overlapped "
            "copies), or drop techniques.activation_offload",
        )
    if tech.optimizer_in_backward:
        _check_optimizer_in_backward(cfg)
    if tech.fp8 not in ("off", "auto"):
        _check_fp8(cfg)
    if out.resume and out.overwrite:
        raise ConfigError(
            "output.resume and output.overwrite contradict each other (continue the run vs "
            "start it again).",
            hint="drop one of --output.resume / --output.overwrite",
        )


def _check_preference(cfg: Config) -> None:
    """The preference section: ranges, and a reference only where the objective has one."""
    pref, objective = cfg.preference, cfg.training.objective
    if pref.beta != "auto" and pref.beta <= 0:
        raise ConfigError(
            f"preference.beta must be positive, got {pref.beta}.",
            hint="set preference.beta to e.g. 0.1",
        )
    if not 0.0 <= pref.label_smoothing < 0.5:
        raise ConfigError(
            f"preference.label_smoothing must be in [0, 0.5), got {pref.label_smoothing}.",
            hint="set preference.label_smoothing to e.g. 0.1 (0 = plain DPO)",
        )
    if pref.simpo_gamma_ratio < 0:
        raise ConfigError(
            f"preference.simpo_gamma_ratio must not be negative, got {pref.simpo_gamma_ratio}.",
            hint="set preference.simpo_gamma_ratio to e.g. 0.5",
        )
    if pref.reference != "auto" and objective in ("orpo", "simpo"):
        raise ConfigError(
            f"preference.reference={pref.reference} is set, but training.objective={objective} "
            "uses no reference model.",
            hint="drop preference.reference, or set training.objective=dpo",
        )
    if pref.reference == "adapters" and not cfg.techniques.lora.enabled:
        raise ConfigError(
            "preference.reference=adapters needs LoRA: the reference is the base model with the "
            "adapters switched off.",
            hint="add --techniques.lora.enabled true, or set preference.reference=precomputed",
        )
    if objective in ("dpo", "orpo", "simpo") and cfg.data.format not in ("auto", "preference"):
        raise ConfigError(
            f"training.objective={objective} trains on preference pairs, but data.format="
            f"{cfg.data.format}.",
            hint="set data.format=preference (or auto) with prompt / chosen / rejected columns",
        )
    _check_kto(cfg)
    _check_reward(cfg)


def _check_reward(cfg: Config) -> None:
    """What a reward model (objectives/reward.py) cannot be combined with."""
    pref, tech = cfg.preference, cfg.techniques
    if cfg.training.objective != "reward":
        if pref.center_rewards_coefficient is not None:
            raise ConfigError(
                "preference.center_rewards_coefficient is set, but training.objective="
                f"{cfg.training.objective}.",
                hint="drop it, or set --training.objective reward",
            )
        return
    reasons = [
        (
            cfg.data.format not in ("auto", "preference"),
            f"data.format={cfg.data.format}: it trains on preference pairs",
            "set data.format=preference (or auto) with prompt / chosen / rejected columns",
        ),
        (
            tech.padding_free,
            "techniques.padding_free: the head scores each row's last token, so every sequence "
            "needs a row of its own",
            "set techniques.padding_free false",
        ),
        (
            pref.reference != "auto",
            f"preference.reference={pref.reference}: a reward model has no reference",
            "drop preference.reference",
        ),
        (
            tech.lora.merge_on_save,
            "techniques.lora.merge_on_save: the merge rebuilds a causal LM",
            "set techniques.lora.merge_on_save false (the adapter and the head are saved)",
        ),
    ]
    for bad, why, fix in reasons:
        if bad:
            raise ConfigError(f"training.objective=reward cannot run with {why}.", hint=fix)


def _check_kto(cfg: Config) -> None:
    pref, objective = cfg.preference, cfg.training.objective
    for name, value in (
        ("desirable_weight", pref.desirable_weight),
        ("undesirable_weight", pref.undesirable_weight),
    ):
        if value <= 0:
            raise ConfigError(
                f"preference.{name} must be positive, got {value}.",
                hint=f"set preference.{name} to e.g. 1.0",
            )
    if objective != "kto":
        return
    if cfg.data.format not in ("auto", "unpaired", "preference"):
        raise ConfigError(
            f"training.objective=kto trains on labelled completions, but data.format="
            f"{cfg.data.format}.",
            hint="set data.format=unpaired (prompt / completion / label columns), preference "
            "(pairs, each split in two), or auto",
        )
    if cfg.training.micro_batch_size < 2:
        # TRL refuses it too: the KL estimate of one example is its own reward
        raise ConfigError(
            "training.objective=kto needs training.micro_batch_size >= 2: its KL estimate comes "
            "from the other examples of the micro-batch.",
            hint="set training.micro_batch_size to 2 or more",
        )


def _check_optimizer_in_backward(cfg: Config) -> None:
    """What an update inside backward cannot do (see techniques/optimizer_in_backward.py)."""
    tech, t = cfg.techniques, cfg.training
    reasons = [
        (
            t.grad_accum > 1,
            f"training.grad_accum={t.grad_accum}: each micro-batch's gradient would be applied "
            "before the next one is added",
            "set training.grad_accum=1 (a larger micro-batch instead)",
        ),
        (
            t.max_grad_norm > 0,
            f"training.max_grad_norm={t.max_grad_norm}: the global norm is only known once every "
            "gradient exists",
            "set training.max_grad_norm=0",
        ),
        (
            tech.precision == "fp16",
            "techniques.precision=fp16: loss scaling must check all gradients before any update",
            "use bf16 (or fp32)",
        ),
        (
            tech.offload != "none",
            f"techniques.offload={tech.offload}: DeepSpeed runs its own optimizer",
            "set techniques.offload=none",
        ),
    ]
    for bad, why, fix in reasons:
        if bad:
            raise ConfigError(
                f"techniques.optimizer_in_backward cannot be combined with {why}.", hint=fix
            )


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d[part]
    return d


def _check_fp8(cfg: Config) -> None:
    """What FP8 training (techniques/fp8.py) cannot be combined with."""
    tech = cfg.techniques
    if tech.lora.quantize_base != "none":
        raise ConfigError(
            f"techniques.fp8={tech.fp8} cannot be combined with techniques.lora.quantize_base="
            f"{tech.lora.quantize_base}: a bitsandbytes base has no Linear weights to cast to "
            "float8.",
            hint="set techniques.lora.quantize_base=none (float8 matmuls on the bf16 base), or "
            "techniques.fp8=off",
        )
    if tech.offload != "none":
        raise ConfigError(
            f"techniques.fp8={tech.fp8} cannot be combined with techniques.offload={tech.offload}: "
            "an offloaded step is bound by host traffic, not by matmuls, and DeepSpeed's engine "
            "with torchao's float8 layers is untested here.",
            hint="set techniques.offload=none, or techniques.fp8=off",
        )
