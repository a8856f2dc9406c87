"""Mixed precision: which compute dtype, and the Accelerate setting that applies it."""

from __future__ import annotations

import logging

from onegpu.config import TechniquesConfig
from onegpu.errors import UnavailableError
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


def resolve_precision(tcfg: TechniquesConfig, device: DeviceInfo) -> str:
    """'auto' -> bf16 where the GPU has it, fp16 on older GPUs, fp32 on CPU (where bf16/fp16 math
    is emulated and many times slower)."""
    p = tcfg.precision
    if p == "auto":
        if device.type == "cuda":
            return "bf16" if device.bf16 else "fp16"
        return "fp32"
    if p in ("bf16", "bf16-pure") and device.type == "cuda" and not device.bf16:
        raise UnavailableError(f"techniques.precision={p}: {device.name} has no bf16 support.",
                               hint="use techniques.precision=fp16 (with loss scaling) on this GPU")
    return p


def accelerate_mixed_precision(precision: str) -> str:
    """Accelerate's name for the autocast policy; pure bf16 needs no autocast (weights are bf16)."""
    return {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "no"}[precision]


def weights_dtype(precision: str):
    import torch

    return torch.bfloat16 if precision == "bf16-pure" else torch.float32
