"""Mixture-of-Experts: train the router's load balancing too.

Mixtral / Qwen-MoE style models compute a load-balancing loss only when their config asks for
router logits (off by default); without it a few experts take every token.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def apply_moe_aux_loss(model, device_type: str) -> bool:
    """Make MoE models return their load-balancing loss (off by default in their configs), with
    experts that can run in the weights' dtype on ``device_type`` (see ``experts_kernel``)."""
    config = model.config
    if getattr(config, "router_aux_loss_coef", None) is None or not hasattr(
        config, "output_router_logits"
    ):
        return False
    config.output_router_logits = True
    use_experts_kernel(model, device_type)
    return True


def use_experts_kernel(model, device_type: str) -> None:
    """Switch the model's experts to ``experts_kernel(model, device_type)`` where it differs."""
    kernel = experts_kernel(model, device_type)
    if kernel != model.config._experts_implementation:
        model.set_experts_implementation(kernel)


def experts_kernel(model, device_type: str) -> str:
    """transformers' default experts kernel, torch's grouped_mm, takes bf16 only on CUDA GPUs; under
    fp32 master weights (precision bf16 with autocast, or fp32) it gets fp32 and stops the step
    ("Expected inputs of BF16 type"). A CUDA run of such weights runs the per-expert loop ("eager")
    instead: the same math, no (tokens x experts) gather. Decided by the run's device and the
    weights' dtype, never by whether this process could reach a GPU: the planner's probe, on CPU in
    a process that has one, must build what the run it plans will build."""
    current = model.config._experts_implementation
    weights = next(model.parameters()).dtype
    if current == "grouped_mm" and weights != torch.bfloat16 and device_type == "cuda":
        log.info(
            "MoE experts: per-expert loop, not grouped_mm (CUDA grouped_mm takes bf16 weights "
            "only, these are %s)",
            str(weights).removeprefix("torch."),
        )
        return "eager"
    return current


def moe_aux_term(model, out, labels: torch.Tensor) -> torch.Tensor | float:
    """coef x aux_loss x (target tokens of this micro-batch).

    The aux loss is a per-batch mean; weighting it by the micro-batch's target tokens keeps the
    token-sum convention, so after the loop divides by the accumulated token count the step adds
    coef x (token-weighted mean aux loss), the same as one big batch would.
    """
    aux = getattr(out, "aux_loss", None)
    if aux is None or not model.training:  # validation loss stays plain cross-entropy
        return 0.0
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    return coef * aux.float() * (labels != -100).sum()  # -100: the ignored label (loss.IGNORE)
