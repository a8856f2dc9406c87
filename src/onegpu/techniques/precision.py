"""Mixed precision: which compute dtype, the Accelerate setting that applies it, loss scaling,
TF32."""

from __future__ import annotations

import logging

from onegpu.config import TechniquesConfig
from onegpu.errors import UnavailableError
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


def resolve_precision(tcfg: TechniquesConfig, device: DeviceInfo) -> str:
    """'auto' -> bf16 where the GPU has it, fp16 on older GPUs, fp32 on CPU (where bf16/fp16 math
    is emulated and many times slower). FP8 (techniques.fp8, its matmuls' precision) is checked
    here too: one clear error where the device has no FP8 tensor cores."""
    from onegpu.techniques.fp8 import check_device

    check_device(tcfg, device)
    p = tcfg.precision
    if p == "auto":
        if device.type == "cuda":
            return "bf16" if device.bf16 else "fp16"
        return "fp32"
    if p in ("bf16", "bf16-pure") and device.type == "cuda" and not device.bf16:
        cap = ".".join(map(str, device.capability)) if device.capability else "unknown"
        raise UnavailableError(
            f"techniques.precision={p}: {device.name} (compute capability {cap}) has no bf16 "
            "support; bf16 needs an Ampere or newer GPU (capability 8.0+).",
            hint="use techniques.precision=fp16 (with loss scaling) on this GPU",
        )
    if p in ("fp16", "bf16", "bf16-pure") and device.type == "cpu":
        log.warning(
            "techniques.precision=%s on CPU: 16-bit math is emulated here and much slower than "
            "fp32",
            p,
        )
    return p


def accelerate_mixed_precision(precision: str) -> str:
    """Accelerate's name for the autocast policy; pure bf16 needs no autocast (weights are bf16)."""
    return {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "no"}[precision]


def weights_dtype(precision: str):
    import torch

    return torch.bfloat16 if precision == "bf16-pure" else torch.float32


def enable_loss_scaling(accelerator, precision: str, init_scale: float = 2.0**16) -> None:
    """Give fp16 on CPU the dynamic loss scaler Accelerate only creates for GPUs.

    Accelerate silently runs mixed_precision="fp16" on CPU in fp32 (no autocast, no scaler). torch
    has a CPU GradScaler and fp16 CPU autocast, so we install the scaler and switch Accelerate's
    native AMP on: its backward() then scales the loss, clip_grad_norm_ unscales, and the wrapped
    optimizer skips steps whose gradients overflowed and lowers the scale.
    """
    import torch

    # GPUs get their scaler from Accelerate (DeepSpeed brings its own), so only CPU needs one here.
    if precision != "fp16" or accelerator.scaler is not None or accelerator.device.type != "cpu":
        return
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    accelerator.native_amp = True
    log.info("fp16 on CPU: dynamic loss scaling with torch.amp.GradScaler('cpu')")


def apply_tf32(tcfg: TechniquesConfig, device: DeviceInfo) -> bool:
    """Switch TF32 matmuls/convolutions on or off; returns whether they are on.

    Default (tf32=None) is on for Ampere+ GPUs: fp32 matmuls then run on tensor cores with a 10-bit
    mantissa, which training tolerates. Asking for it where there is none is ignored with a warning.
    """
    want = device.tf32 if tcfg.tf32 is None else tcfg.tf32
    if want and not device.tf32:
        log.warning(
            "techniques.tf32=true ignored: %s has no TF32 tensor cores (needs an Ampere+ GPU)",
            device.name,
        )
        want = False
    set_tf32(want)
    if device.type == "cuda":
        log.info("TF32 matmuls %s", "on" if want else "off")
    return want


# torch >= 2.9 has two APIs for TF32 (allow_tf32 / set_float32_matmul_precision, and per-backend
# fp32_precision); once anything in the process uses the new one (transformers'
# TrainingArguments(tf32=True) does), reading a legacy flag raises. So TF32 is set and read through
# the new API only.
def _tf32_backends() -> tuple:
    import torch

    b = torch.backends
    return b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn


def tf32_state() -> tuple[str, ...]:
    """The fp32 precision of each CUDA backend ("tf32", "ieee" or "none" = unset), to restore
    later."""
    return tuple(b.fp32_precision for b in _tf32_backends())


def set_tf32(on: bool | tuple[str, ...]) -> None:
    """TF32 on or off for CUDA matmuls and cuDNN, or a saved ``tf32_state()`` put back."""
    backends = _tf32_backends()
    values = on if isinstance(on, tuple) else ("tf32" if on else "ieee",) * len(backends)
    for backend, value in zip(backends, values, strict=True):
        backend.fp32_precision = value


def warn_fp16_on_bf16_model(model_config, precision: str) -> bool:
    """fp16 on a model pretrained in bf16 overflows activations to inf/NaN (transformers#14189)."""
    import torch

    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    is_bf16 = dtype in (torch.bfloat16, "bfloat16")
    if precision == "fp16" and is_bf16:
        log.warning(
            "techniques.precision=fp16 on a model stored in bfloat16: its activations can exceed "
            "the fp16 range and turn the loss into NaN (transformers#14189); prefer precision=bf16 "
            "(or fp32)"
        )
        return True
    return False
