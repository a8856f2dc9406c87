"""One training setup the planner can choose: batch split and the memory/speed methods."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from onegpu.config import Config


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    grad_accum: int
    precision: str = "fp32"  # fp32, fp16, bf16 (autocast, fp32 weights) or bf16-pure
    checkpointing: str = "off"  # off, every-n, full, offload
    optimizer: str = "adamw"
    loss_chunk: int = 0  # tokens per chunk of the fused loss; 0 = the plain loss
    compile: str = "off"
    lora_rank: int = 0  # 0 = full fine-tuning
    quantize_base: str = "none"  # none, nf4, int8 (LoRA only)
    offload: str = "none"  # none, zero2-cpu, zero3-cpu
    every: int = 2  # checkpointing_every for every-n
    in_backward: bool = False  # optimizer step inside backward (grad_accum 1, no global clipping)
    lora_targets: str = "all-linear"  # lora.targets: which linear layers get adapters
    lora_dtype: str = "auto"  # lora.dtype as configured (settled per precision by techniques.lora.adapter_dtype)
    objective: str = "sft"  # training.objective: dpo / orpo / simpo run two sequences (chosen, rejected) per example
    reference: str = "auto"  # preference.reference as configured (settled by objectives.reference.choose)

    @property
    def rows_per_example(self) -> int:
        """Sequences through the model per example: a preference pair is two."""
        return 1 if self.objective == "sft" else 2

    @property
    def reference_kind(self) -> str | None:
        """DPO's reference for this setup (None, adapters, precomputed, copy): LoRA changes what auto means."""
        from onegpu.objectives.reference import choose

        return choose(self.objective, self.reference, bool(self.lora_rank))

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum

    @property
    def method(self) -> str:
        if self.offload != "none":
            return f"offload:{self.offload}"
        if self.lora_rank:
            return "qlora" if self.quantize_base != "none" else "lora"
        return "full"

    @property
    def adapter_dtype(self) -> str:
        """"fp32" or "bf16": the dtype training gives the adapters under this precision."""
        from onegpu.techniques.lora import adapter_dtype

        return adapter_dtype(self.lora_dtype, self.precision)

    def label(self) -> str:
        parts = [f"mb{self.micro_batch}x{self.grad_accum}", self.precision]
        if self.checkpointing != "off":
            parts.append("ckpt-" + (f"every{self.every}" if self.checkpointing == "every-n" else self.checkpointing))
        parts.append(self.optimizer + ("-in-backward" if self.in_backward else ""))
        if self.loss_chunk:
            parts.append(f"fused-loss{self.loss_chunk}")
        if self.compile != "off":
            parts.append("compile")
        if self.lora_rank:
            parts.append(("q" + self.quantize_base + "-" if self.quantize_base != "none" else "") + f"lora{self.lora_rank}"
                         + ("" if self.lora_targets == "all-linear" else f"[{self.lora_targets}]")
                         + ("-bf16" if self.adapter_dtype == "bf16" else ""))
        if self.offload != "none":
            parts.append(self.offload)
        return " ".join(parts)

    def apply(self, cfg: Config) -> Config:
        """A copy of cfg that trains with this setup (everything else unchanged)."""
        out = copy.deepcopy(cfg)
        out.training.micro_batch_size, out.training.grad_accum = self.micro_batch, self.grad_accum
        t = out.techniques
        t.precision, t.checkpointing, t.checkpointing_every = self.precision, self.checkpointing, self.every
        t.optimizer, t.loss_chunk_size, t.compile, t.offload = self.optimizer, self.loss_chunk, self.compile, self.offload
        # A fused candidate keeps loss=auto where it was asked (a model without support falls back).
        t.loss = "plain" if not self.loss_chunk else ("fused" if t.loss == "plain" else t.loss)
        t.optimizer_in_backward = self.in_backward
        if self.in_backward:  # the global norm does not exist when each update happens in backward
            out.training.max_grad_norm = 0.0
        t.lora.enabled = bool(self.lora_rank)
        if self.lora_rank:
            t.lora.r, t.lora.quantize_base, t.lora.targets = self.lora_rank, self.quantize_base, self.lora_targets
            t.lora.dtype = self.lora_dtype
        out.plan = "off"  # the result is a concrete setup, not a request to plan again
        return out

