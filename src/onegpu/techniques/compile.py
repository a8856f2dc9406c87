"""torch.compile: whole model or one decoder block at a time ("regional").

Regional compilation compiles one block and reuses the code for every identical block, so the
compile takes seconds instead of minutes for nearly the same speed. Modules are compiled in place
(``nn.Module.compile``), so the model keeps its type, its state_dict keys and save_pretrained.

Sequence lengths are bucketed by the collator (data.pad_to_multiple), so the compiled code sees a
handful of shapes instead of one per padded length (pytorch#188150).
"""

from __future__ import annotations

import logging

from onegpu.config import TechniquesConfig
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

# Modes only inductor understands; other backends take options through their own mechanisms.
_INDUCTOR_MODES = {"default": None, "max-autotune": "max-autotune", "reduce-overhead": "reduce-overhead"}


def compile_kwargs(tcfg: TechniquesConfig, device_type: str = "cuda") -> dict:
    """torch.compile arguments for the configured mode and backend, checked."""
    import torch

    backend = tcfg.compile_backend
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        choices = ", ".join(torch._dynamo.list_backends())
        raise ConfigError(f"techniques.compile_backend: unknown backend '{backend}'.", hint=f"choose one of: {choices}")
    kwargs = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = _INDUCTOR_MODES[tcfg.compile]
    elif tcfg.compile != "default":
        raise ConfigError(f"techniques.compile={tcfg.compile} is an inductor mode, but compile_backend='{backend}'.",
                          hint="use techniques.compile=default with this backend, or compile_backend=inductor")
    if tcfg.compile == "reduce-overhead" and device_type != "cuda":
        raise UnavailableError("techniques.compile=reduce-overhead uses CUDA graphs and needs a CUDA GPU.",
                               hint="use techniques.compile=default on this device")
    return kwargs


def apply_compile(model, tcfg: TechniquesConfig, device_type: str = "cuda"):
    """Compile ``model`` in place (whole, or each decoder block); returns the model."""
    if tcfg.compile == "off":
        return model
    kwargs = compile_kwargs(tcfg, device_type)
    blocks = _blocks(model) if tcfg.compile_regional else []
    if tcfg.compile_regional and not blocks:
        log.warning("compile_regional: no repeated decoder blocks found; compiling the whole model")
    for block in blocks:
        block.compile(**kwargs)
    if not blocks:
        model.compile(**kwargs)
    log.info("torch.compile %s (backend %s): %s", tcfg.compile, kwargs["backend"],
             f"{len(blocks)} decoder blocks" if blocks else "whole model")
    return model


def _blocks(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def is_compiled(module) -> bool:
    """Whether ``module`` itself runs through torch.compile (in-place compile)."""
    return getattr(module, "_compiled_call_impl", None) is not None
