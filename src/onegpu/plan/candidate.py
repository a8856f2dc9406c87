"""One training setup the planner can choose: the config sections a run trains with, settled.

A candidate is a set of overrides on the real configs, not a parallel vocabulary: it holds the
``TrainingConfig`` (batch split, objective), ``TechniquesConfig`` and ``PreferenceConfig`` a run
would train with, and the memory, speed and activation models read their fields. Settled means
what training resolves is resolved: ``precision``, ``compile`` and ``fp8`` are never ``auto``, and
``loss_chunk_size`` is the fused loss's chunk (0 with ``loss=plain``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from onegpu.config import (
    Config,
    GRPOConfig,
    LoraConfig,
    PreferenceConfig,
    TechniquesConfig,
    TrainingConfig,
)


@dataclass(frozen=True)
class Candidate:
    training: TrainingConfig
    """micro_batch_size, grad_accum and objective of this setup (max_grad_norm 0 with the step
    in backward, where no global norm exists)."""
    techniques: TechniquesConfig
    """The methods this setup trains with, settled (see the module docstring)."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """preference.reference as configured (settled by objectives.reference.choose)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO's rollouts (group size, completion length, iterations) and reference (beta)."""

    @property
    def lora_rank(self) -> int:
        """Rank of the trained adapters; 0 = full fine-tuning (lora.enabled off)."""
        return self.techniques.lora.r if self.techniques.lora.enabled else 0

    @property
    def quantize_base(self) -> str:
        """The base's quantization under LoRA; "none" for full fine-tuning, which ignores it."""
        return self.techniques.lora.quantize_base if self.lora_rank else "none"

    @property
    def rows_per_example(self) -> int:
        """Sequences trained on per example: a preference pair is two (a GRPO example is one
        completion; a KTO example one, its mismatched sequence a no-grad forward counted in
        speed.flops_per_token)."""
        return 2 if self.training.objective in ("dpo", "orpo", "simpo", "reward") else 1

    def sequence_tokens(self, seq_len: int) -> int:
        """Tokens of one training sequence at data.seq_len: GRPO's rows are a prompt of up to
        seq_len tokens and its completion (with tools, its conversation: completion_tokens)."""
        grpo = self.training.objective == "grpo"
        return seq_len + (self.grpo.completion_tokens() if grpo else 0)

    @property
    def reference_kind(self) -> str | None:
        """DPO's reference for this setup (None, adapters, precomputed, copy): LoRA changes what
        auto means."""
        from onegpu.objectives.reference import choose, grpo_reference

        if self.training.objective == "grpo":
            return grpo_reference(self.grpo, bool(self.lora_rank))
        return choose(self.training.objective, self.preference.reference, bool(self.lora_rank))

    @property
    def effective_batch(self) -> int:
        return self.training.micro_batch_size * self.training.grad_accum

    @property
    def method(self) -> str:
        if self.techniques.offload != "none":
            return f"offload:{self.techniques.offload}"
        if self.lora_rank:
            return "qlora" if self.quantize_base != "none" else "lora"
        return "full"

    @property
    def adapter_dtype(self) -> str:
        """ "fp32" or "bf16": the dtype training gives the adapters under this precision."""
        from onegpu.techniques.lora import adapter_dtype

        return adapter_dtype(self.techniques.lora.dtype, self.techniques.precision)

    def label(self) -> str:
        t, tr = self.techniques, self.training
        parts = [f"mb{tr.micro_batch_size}x{tr.grad_accum}", t.precision]
        if t.checkpointing != "off":
            every = f"every{t.checkpointing_every}"
            parts.append("ckpt-" + (every if t.checkpointing == "every-n" else t.checkpointing))
        parts.append(t.optimizer + ("-in-backward" if t.optimizer_in_backward else ""))
        if t.activation_offload:
            parts.append("act-offload")
        if t.tiled_mlp == "on":
            parts.append("tiled-mlp")
        if t.loss_chunk_size:
            parts.append(f"fused-loss{t.loss_chunk_size}")
        if t.compile != "off":
            parts.append("compile")
        if t.fp8 != "off":  # tensorwise unless named; the layers kept in bf16 after a minus
            recipe = "" if t.fp8 == "tensorwise" else f"-{t.fp8}"
            parts.append(f"fp8{recipe}" + (f"[-{t.fp8_skip}]" if t.fp8_skip else ""))
        if self.lora_rank:
            quant = "q" + self.quantize_base + "-" if self.quantize_base != "none" else ""
            targets = "" if t.lora.targets == "all-linear" else f"[{t.lora.targets}]"
            bf16 = "-bf16" if self.adapter_dtype == "bf16" else ""
            parts.append(f"{quant}lora{self.lora_rank}{targets}{bf16}")
        if t.offload != "none":
            parts.append(t.offload)
        return " ".join(parts)

    def apply(self, cfg: Config) -> Config:
        """A copy of cfg that trains with this setup (its other sections unchanged)."""
        out = copy.deepcopy(cfg)
        out.training = copy.deepcopy(self.training)
        out.techniques = copy.deepcopy(self.techniques)
        out.preference = copy.deepcopy(self.preference)
        out.grpo = copy.deepcopy(self.grpo)
        out.plan = "off"  # the result is a concrete setup, not a request to plan again
        return out


def setup(
    micro_batch_size: int,
    grad_accum: int = 1,
    base: Config | None = None,
    training: dict | None = None,
    preference: dict | None = None,
    grpo: dict | None = None,
    **techniques,
) -> Candidate:
    """A candidate: ``base``'s sections (default: the defaults) with these overrides.

    ``techniques`` are TechniquesConfig fields; ``lora`` may be a dict of LoraConfig fields, which
    trains adapters (enabled=True unless given). Unsettled values are settled as the planner does
    by default: precision fp32, compile and fp8 off, loss fused exactly when loss_chunk_size > 0,
    and the step in backward without gradient clipping (it has no global norm). tiled_mlp stays as
    given: auto tiles from tiled_mlp_min_seq tokens, as training does."""
    base = base or Config()
    lora = techniques.pop("lora", None)
    if isinstance(lora, dict):
        techniques["lora"] = dataclasses.replace(base.techniques.lora, **{"enabled": True, **lora})
    elif isinstance(lora, LoraConfig):
        techniques["lora"] = lora
    t = dataclasses.replace(base.techniques, **techniques)
    chunk = t.loss_chunk_size
    t = dataclasses.replace(
        t,
        precision="fp32" if t.precision == "auto" else t.precision,
        compile="off" if t.compile == "auto" else t.compile,
        fp8="off" if t.fp8 == "auto" else t.fp8,
        loss="plain" if not chunk else ("fused" if t.loss == "plain" else t.loss),
    )
    tr = dataclasses.replace(
        base.training,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        **(training or {}),
    )
    if t.optimizer_in_backward:
        tr = dataclasses.replace(tr, max_grad_norm=0.0)
    pref = dataclasses.replace(base.preference, **(preference or {}))
    return Candidate(tr, t, pref, dataclasses.replace(base.grpo, **(grpo or {})))
