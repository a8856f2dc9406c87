"""torch.compile: whole model or one decoder block at a time ("regional").

Regional compilation compiles one block and reuses the code for every identical block, so the
compile takes seconds instead of minutes for nearly the same speed. Modules are compiled in place
(``nn.Module.compile``), so the model keeps its type, its state_dict keys and save_pretrained.

Sequence lengths are bucketed by the collator (data.pad_to_multiple), so the compiled code sees a
handful of shapes instead of one per padded length (pytorch#188150).
"""

from __future__ import annotations

import logging

from onegpu.config import Config, TechniquesConfig
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

# Below this many steps a first compile (~20 s of C++ on a CPU, ~1 min on a GPU for a 1B model;
# seconds once inductor's cache is warm) costs more than a short run gains.
AUTO_MIN_STEPS = 50

# Modes only inductor understands; other backends take options through their own mechanisms.
_INDUCTOR_MODES = {
    "default": None,
    "max-autotune": "max-autotune",
    "reduce-overhead": "reduce-overhead",
}


def compile_kwargs(tcfg: TechniquesConfig, device_type: str = "cuda") -> dict:
    """torch.compile arguments for the configured mode and backend, checked."""
    import torch

    backend = tcfg.compile_backend
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        choices = ", ".join(torch._dynamo.list_backends())
        raise ConfigError(
            f"techniques.compile_backend: unknown backend '{backend}'.",
            hint=f"choose one of: {choices}",
        )
    kwargs = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = _INDUCTOR_MODES[tcfg.compile]
    elif tcfg.compile != "default":
        raise ConfigError(
            f"techniques.compile={tcfg.compile} is an inductor mode, but "
            f"compile_backend='{backend}'.",
            hint="use techniques.compile=default with this backend, or compile_backend=inductor",
        )
    if tcfg.compile == "reduce-overhead" and device_type != "cuda":
        raise UnavailableError(
            "techniques.compile=reduce-overhead uses CUDA graphs and needs a CUDA GPU.",
            hint="use techniques.compile=default on this device",
        )
    return kwargs


def resolve_compile(cfg: Config, device_type: str) -> str:
    """The compile mode a run uses: techniques.compile, with auto settled to "default" or "off"."""
    t = cfg.techniques
    if t.compile != "auto":
        return t.compile
    reason = _auto_off_reason(cfg, device_type)
    if reason:
        log.info("techniques.compile=auto: not compiling (%s)", reason)
        return "off"
    return "default"


def auto_compiles(cfg: Config, device_type: str) -> bool:
    """Whether compile=auto compiles this run (resolve_compile's decision, without its log line)."""
    return cfg.techniques.compile == "auto" and _auto_off_reason(cfg, device_type) is None


def has_cpu_compiler() -> bool:
    """A C++ compiler for inductor's CPU kernels."""
    import shutil

    return bool(shutil.which("g++") or shutil.which("c++"))


def _auto_off_reason(cfg: Config, device_type: str) -> str | None:
    t = cfg.techniques
    if cfg.training.max_steps < AUTO_MIN_STEPS:
        return f"a {cfg.training.max_steps}-step run: compiling would take longer than it saves"
    if t.offload != "none" or t.checkpointing == "offload":
        return "offloaded state moves between devices every step; compiled code gains little there"
    if t.lora.enabled and t.lora.quantize_base != "none":
        return "bitsandbytes-quantized layers break the graph into pieces"
    if t.compile_backend != "inductor":
        return (
            f"backend {t.compile_backend} is only used when asked for (techniques.compile=default)"
        )
    if device_type == "cpu" and not has_cpu_compiler():
        return "no C++ compiler (g++) for inductor's CPU kernels"
    if device_type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
    elif device_type != "cpu":
        return f"not tried on {device_type} devices"
    return None


def apply_compile(model, tcfg: TechniquesConfig, device_type: str = "cuda"):
    """Compile ``model`` in place (whole, or each decoder block); returns the model. An unresolved
    "auto" (see resolve_compile) compiles nothing."""
    if tcfg.compile in ("off", "auto"):
        return model
    kwargs = compile_kwargs(tcfg, device_type)
    blocks = _blocks(model) if tcfg.compile_regional else []
    if tcfg.compile_regional and not blocks:
        log.warning("compile_regional: no repeated decoder blocks found; compiling the whole model")
    for block in blocks:
        block.compile(**kwargs)
    if not blocks:
        model.compile(**kwargs)
    log.info(
        "torch.compile %s (backend %s): %s",
        tcfg.compile,
        kwargs["backend"],
        f"{len(blocks)} decoder blocks" if blocks else "whole model",
    )
    return model


def _blocks(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
