"""Step time: FLOPs per token over the GPU's peak times an efficiency, plus the optimizer step.

Efficiency (the model-FLOPs utilisation a real run reaches) is measured by the probe and stored per
GPU model and precision in the onegpu cache. Without a measurement we use DEFAULT_EFFICIENCY, and
every figure built on it is shown as "(uncalibrated)".
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from onegpu.hardware import GpuSpec
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate
from onegpu.plan.memory import trainable_params
from onegpu.paths import cache_dir

# Typical MFU of a well-fed single-GPU transformer step (public nanoGPT/torchtitan reports: 35-50%
# on A100/H100 in bf16). Only used until the probe has measured this GPU.
DEFAULT_EFFICIENCY = 0.40
# Small micro-batches under-fill the GPU; utilisation reaches half its peak at this many tokens
# per micro-batch on a GPU (fitted by the probe where it has measured more than one size).
HALF_FILL_TOKENS = {"gpu": 512, "cpu": 16}
# Relative speed factors for methods that change kernels, not FLOPs (uncalibrated defaults).
COMPILE_SPEEDUP = 1.15  # fused elementwise ops (torch.compile, inductor)
QLORA_SLOWDOWN = 0.65  # dequantizing 4-bit weights in every matmul
OFFLOAD_PCIE_GBS = 20.0  # effective host<->device bandwidth for ZeRO offload
CPU_ADAM_PARAMS_PER_S = 1.5e9  # DeepSpeed's CPUAdam, a many-core host


@dataclass
class SpeedEstimate:
    tokens_per_s: float
    step_seconds: float
    flops_per_token: float
    efficiency: float
    calibrated: bool


def flops_per_token(shape: ModelShape, c: Candidate, seq_len: int) -> float:
    """arch.flops_per_token for a candidate's LoRA rank and checkpointed layers."""
    from onegpu.plan.activations import checkpointed_layers
    from onegpu.plan.arch import flops_per_token as count

    frac = checkpointed_layers(shape.layers, c.checkpointing, c.every) / max(shape.layers, 1)
    return count(shape, seq_len, c.lora_rank, frac)


def calibration_path():
    return cache_dir() / "calibration.json"


def load_calibration() -> dict:
    path = calibration_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def save_calibration(gpu_key: str, precision: str, efficiency: float, tokens_per_micro: int) -> None:
    """Remember a measured efficiency for this GPU model and precision (used by later plans)."""
    data = load_calibration()
    data.setdefault(gpu_key, {})[_prec_class(precision)] = {
        "efficiency": efficiency, "tokens_per_micro": tokens_per_micro, "measured": time.strftime("%Y-%m-%d")}
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def base_efficiency(spec: GpuSpec, precision: str) -> tuple[float, bool]:
    """(efficiency at a well-filled micro-batch, whether it was measured on this GPU model)."""
    entry = load_calibration().get(spec.key, {}).get(_prec_class(precision))
    if not entry:
        return DEFAULT_EFFICIENCY, False
    # Stored at the probe's micro-batch; undo the fill factor to get the saturated figure.
    return min(1.0, entry["efficiency"] / _fill(spec, entry["tokens_per_micro"])), True


def _fill(spec: GpuSpec, tokens: int) -> float:
    half = HALF_FILL_TOKENS["cpu" if spec.key == "CPU" else "gpu"]
    return tokens / (tokens + half)


def _prec_class(precision: str) -> str:
    return "16bit" if precision in ("fp16", "bf16", "bf16-pure") else "fp32"


def estimate(shape: ModelShape, c: Candidate, seq_len: int, spec: GpuSpec, tf32: bool = True) -> SpeedEstimate:
    """Predicted training throughput (tokens/s) of one setup on one GPU."""
    eff, calibrated = base_efficiency(spec, c.precision)
    eff *= _fill(spec, c.micro_batch * seq_len)
    if c.compile != "off":
        eff *= COMPILE_SPEEDUP
    if c.quantize_base != "none":
        eff *= QLORA_SLOWDOWN
    fpt = flops_per_token(shape, c, seq_len)
    tokens = c.effective_batch * seq_len
    compute = tokens * fpt / (spec.peak_tflops(c.precision, tf32) * 1e12 * eff)
    step = compute + optimizer_seconds(shape, c, spec)
    return SpeedEstimate(tokens / step, step, fpt, eff, calibrated)


def optimizer_seconds(shape: ModelShape, c: Candidate, spec: GpuSpec) -> float:
    """optimizer.step() is memory-bound: bytes read and written per parameter over the bandwidth;
    under ZeRO offload, gradients and weights cross PCIe and Adam runs on the host."""
    n = trainable_params(shape, c)
    if c.offload != "none":
        return n * 4 / (OFFLOAD_PCIE_GBS * 1e9) + n / CPU_ADAM_PARAMS_PER_S
    per_param = {"sgd": 12, "adafactor": 12}.get(c.optimizer, 6 if "8bit" in c.optimizer or "4bit" in c.optimizer else 16)
    per_param += 4  # zeroing / clipping the gradients
    return n * per_param * 2 / (spec.bandwidth_gbs * 1e9)  # read + write
