"""Training start-up advice on the loaded model and the device: not methods applied to a model, but
what a run says once before its first step.

Shape advice: tensor cores run matmuls fastest when the dimensions are multiples of 8 (16-bit)
or, for fp16/bf16 on A100-class and newer GPUs, multiples of 64. A misaligned micro-batch, sequence
length or hidden size still works, only slower; we say so once at start-up rather than change it."""

from __future__ import annotations

import logging

from onegpu.config import Config
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


def check_model_settings(
    cfg: Config, device: DeviceInfo, precision: str, model, stored_config
) -> None:
    """Start-up advice that depends on the loaded model and the device. ``stored_config`` is the
    model's config as saved (its dtype is the one the weights are stored in)."""
    from onegpu.techniques.precision import warn_fp16_on_bf16_model

    warn_fp16_on_bf16_model(stored_config, precision)
    check_shapes(
        cfg.training.micro_batch_size,
        cfg.data.seq_len,
        getattr(model.config, "hidden_size", None),
        precision,
        device,
    )


def preferred_multiple(precision: str, device: DeviceInfo) -> int:
    """64 for 16-bit math on Ampere+ (A100-class) tensor cores, 8 everywhere else."""
    if (
        precision in ("fp16", "bf16", "bf16-pure")
        and device.type == "cuda"
        and device.capability
        and device.capability >= (8, 0)
    ):
        return 64
    return 8


def check_shapes(
    micro_batch: int, seq_len: int, hidden_size: int | None, precision: str, device: DeviceInfo
) -> list[str]:
    """Log one warning per misaligned dimension; returns the warnings (empty when all is aligned).

    Only CUDA GPUs are checked: CPUs and MPS have no tensor-core tiles to fill.
    """
    if device.type != "cuda":
        return []
    multiple = preferred_multiple(precision, device)
    where = f"{precision} on {device.name}"
    found = []
    checks = [
        ("training.micro_batch_size", micro_batch, 8),
        ("data.seq_len", seq_len, multiple),
        ("model hidden_size", hidden_size, multiple),
    ]
    for name, value, want in checks:
        if value and value % want:
            # The batch dimension only has to fill 8-wide tiles; 64 matters for the matmul K/N dims.
            msg = (
                f"{name}={value} is not a multiple of {want}: matmuls on {where} run fastest with "
                f"multiples of {want} (tensor-core tiles); consider {_round(value, want)}"
            )
            log.warning(msg)
            found.append(msg)
    return found


def _round(value: int, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)
