"""Gradient (activation) checkpointing: keep fewer activations, recompute them in backward.

Modes: off; full (every decoder layer); every-n (every n-th layer: trades memory back for speed);
offload (every layer, and the layer inputs kept for the recompute live in host memory instead of
on the GPU). Always non-reentrant: the reentrant variant returns no gradients when the layer inputs
do not require grad, which is the case with frozen embeddings under LoRA (peft#1142).
"""

from __future__ import annotations

import functools
import inspect
import logging

from onegpu.config import TechniquesConfig
from onegpu.errors import UnavailableError

log = logging.getLogger(__name__)


def apply_checkpointing(model, tcfg: TechniquesConfig, device_type: str = "cuda"):
    """Switch checkpointing on in place according to ``tcfg.checkpointing``; returns the model."""
    mode = tcfg.checkpointing
    if mode == "off":
        return model
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UnavailableError(
            f"techniques.checkpointing={mode}: {type(model).__name__} does not support "
            "gradient checkpointing.",
            hint="set techniques.checkpointing=off for this model",
        )
    every = tcfg.checkpointing_every if mode == "every-n" else 1
    offload = mode == "offload"
    if offload and device_type == "cpu":
        log.warning(
            "checkpointing=offload on CPU: activations already live in host memory; "
            "this is plain full checkpointing here"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and {"every_n_layers", "offload"} <= set(
        inspect.signature(enable).parameters
    ):
        enable(
            {"use_reentrant": False}, every_n_layers=every, offload=offload and device_type != "cpu"
        )
    else:  # transformers releases without per-layer selection or offload
        _enable_by_layer(model, every, offload and device_type != "cpu", device_type)
    model.config.use_cache = (
        False  # a KV cache is useless in training and clashes with the recompute
    )
    from onegpu.techniques.vision import no_gradient_to_pixels

    no_gradient_to_pixels(model)
    n_on = len(checkpointed_layers(model))
    log.info(
        "gradient checkpointing %s: %d of %d decoder layers recompute in backward",
        mode,
        n_on,
        len(decoder_layers(model)),
    )
    return model


def _enable_by_layer(model, every: int, offload: bool, device_type: str) -> None:
    """Same effect through the per-layer switch every transformers decoder layer carries."""
    from torch.utils.checkpoint import checkpoint

    func = functools.partial(checkpoint, use_reentrant=False)
    if offload:
        func = functools.partial(_checkpoint_offloaded, device_type=device_type)
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name of the same switch
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = i % every == 0
        layer._gradient_checkpointing_func = func


def _checkpoint_offloaded(function, *args, device_type: str = "cuda", **kwargs):
    """Checkpoint whose saved layer inputs go to pinned host memory until the backward needs
    them."""
    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import checkpoint

    # Pinned pages make the copies asynchronous; there is no pinned allocator without an
    # accelerator.
    with save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def decoder_layers(model) -> list:
    """The repeated transformer blocks (the modules transformers checkpoints one by one)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(model) -> list:
    return [m for m in decoder_layers(model) if getattr(m, "gradient_checkpointing", False)]
