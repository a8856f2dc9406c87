"""Step time: FLOPs per token over the GPU's peak times an efficiency, plus the optimizer step.

Efficiency is the compute-only utilisation of a well-filled micro-batch, without the factors of
methods that change kernels rather than FLOPs (compile, a quantized base) and without the
optimizer step, which is modelled on its own. The probe measures a whole step, takes those parts
back out (``compute_efficiency``) and stores what is left per GPU model and precision, so a probed
setup re-planned predicts exactly what was measured. Without a measurement the efficiency of a
published run on the same GPU class is used (plan/published.py; DEFAULT_EFFICIENCY for classes
without one), and every figure built on it is shown as "(uncalibrated)". The other constants below
are assumptions no probe fits; each estimate lists the ones it used.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from onegpu.hardware import GpuSpec
from onegpu.paths import cache_dir
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate
from onegpu.plan.memory import mlp_tiled, trainable_params
from onegpu.plan.published import (
    COMPILE_SPEEDUP,
    FALLBACK_EFFICIENCY,
    QLORA_SLOWDOWN,
    default_efficiency,
)

# For a GPU class (or fp32 compute) without a published run: an assumption, until a probe measures
# it.
DEFAULT_EFFICIENCY = FALLBACK_EFFICIENCY
# Small micro-batches under-fill the GPU; utilisation reaches half its peak at this many tokens
# per micro-batch (an assumption: a probe measures one micro-batch size, which cannot fit a curve).
HALF_FILL_TOKENS = {"gpu": 512, "cpu": 16}
# Relative speed factors for methods that change kernels, not FLOPs: COMPILE_SPEEDUP and
# QLORA_SLOWDOWN, published figures (plan/published.py), listed as assumptions where used.
OFFLOAD_PCIE_GBS = 20.0  # effective host<->device bandwidth for ZeRO offload
# Host<->device copy rate per direction for activation offload, by the card's PCIe generation:
# the link's 16 lanes carry 15.75 / 31.5 / 63 GB/s per direction (gen3 / gen4 / gen5, PCI-SIG);
# pinned copies reach about 80% of that (an assumption: CUDA's bandwidthTest on a gen4 x16 host
# typically shows 24-26 GB/s). The generation is the vendor's datasheet's.
PCIE_GEN = {
    "T4": 3,
    "V100": 3,
    "V100-16GB": 3,
    "H100": 5,
    "H100-PCIe": 5,
    "H100-NVL": 5,
    "H200": 5,
    "B200": 5,
}  # every other catalogued card: gen4
PCIE_LINK_GBS = {3: 15.75, 4: 31.5, 5: 63.0}
PINNED_COPY_EFFICIENCY = 0.8
CPU_ADAM_PARAMS_PER_S = 1.5e9  # DeepSpeed's CPUAdam, a many-core host
# GRPO's decode steps reach this share of the memory bandwidth reading weights and KV cache (an
# assumption: small-batch decoding in eager transformers runs well below the roofline)
DECODE_BANDWIDTH_SHARE = 0.5


@dataclass
class SpeedEstimate:
    tokens_per_s: float
    step_seconds: float
    flops_per_token: float
    efficiency: float
    calibrated: bool
    assumptions: tuple[
        str, ...
    ] = ()  # constants this figure rests on that no measurement has fitted


def flops_per_token(shape: ModelShape, c: Candidate, seq_len: int) -> float:
    """arch.flops_per_token for a candidate's LoRA rank and checkpointed layers."""
    from onegpu.plan.activation_model import checkpointed_layers
    from onegpu.plan.arch import flops_per_token as count
    from onegpu.plan.arch import forward_flops_per_token

    t = c.techniques
    frac = checkpointed_layers(shape.layers, t.checkpointing, t.checkpointing_every) / max(
        shape.layers, 1
    )
    total = count(shape, seq_len, c.lora_rank, frac, t.lora.targets)
    if mlp_tiled(shape, c, seq_len):  # each tile's MLP forward runs again in its backward
        total += 2 * 3 * shape.hidden * shape.intermediate * shape.layers
    if c.training.objective not in ("sft", "reward"):  # a reward model has no LM head
        # per-token log-probs: the fused head runs again in backward (fused_loss.fused_token_logps)
        total += 2 * shape.vocab * shape.hidden if t.loss_chunk_size else 0
        # KTO: each example's mismatched sequence (objectives/kto.py), one more no-grad forward
        # under the policy and, with a per-step reference, under the reference too
        forwards = 2 if c.training.objective == "kto" else 1
        if c.training.objective == "kto":
            total += forward_flops_per_token(shape, seq_len)
        if c.reference_kind in (
            "adapters",
            "copy",
        ):  # the reference's forward, every step
            total += forwards * forward_flops_per_token(shape, seq_len)
        if c.training.objective == "grpo" and c.grpo.num_iterations > 1:
            # the log-probs at sampling: one forward per batch of rollouts, which serves mu steps
            total += forward_flops_per_token(shape, seq_len) / c.grpo.num_iterations
    return total


def calibration_path():
    return cache_dir() / "calibration.json"


def load_calibration() -> dict:
    path = calibration_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


CALIBRATION_KIND = (
    "compute-saturated"  # what "efficiency" means in the stored entries (see the docstring)
)


def save_calibration(
    gpu_key: str, precision: str, efficiency: float, tokens_per_micro: int
) -> None:
    """Remember a measured compute-only, saturated efficiency for this GPU model and precision."""
    data = load_calibration()
    data.setdefault(gpu_key, {})[_prec_class(precision)] = {
        "efficiency": efficiency,
        "kind": CALIBRATION_KIND,
        "tokens_per_micro": tokens_per_micro,
        "measured": time.strftime("%Y-%m-%d"),
    }
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def base_efficiency(spec: GpuSpec, precision: str) -> tuple[float, bool]:
    """(compute-only efficiency at a well-filled micro-batch, whether it was measured on this GPU
    model). Entries written before efficiencies were stored compute-only are not used."""
    entry = load_calibration().get(spec.key, {}).get(_prec_class(precision))
    if not entry or entry.get("kind") != CALIBRATION_KIND:
        return default(spec, precision)[0], False
    return entry["efficiency"], True


def default(spec: GpuSpec, precision: str) -> tuple[float, str]:
    """(efficiency, its label) before any probe: a published 16-bit run on this GPU class, if
    any."""
    if spec.key == "CPU" or _prec_class(precision) != "16bit":
        return (
            DEFAULT_EFFICIENCY,
            f"efficiency {DEFAULT_EFFICIENCY:.2f} (assumed; no probe on this device yet)",
        )
    return default_efficiency(spec.capability)


def method_factor(c: Candidate) -> float:
    """Speed factors of methods that change kernels, not FLOPs (assumed, see the constants)."""
    factor = COMPILE_SPEEDUP if c.techniques.compile != "off" else 1.0
    return factor * (QLORA_SLOWDOWN if c.quantize_base != "none" else 1.0)


def fp8_factor(shape: ModelShape, c: Candidate, seq_len: int, spec: GpuSpec) -> float:
    """FP8's compute speed-up for this setup (plan/fp8.speedup: its float8 layers' roofline)."""
    if c.techniques.fp8 == "off":
        return 1.0
    from onegpu.plan.fp8 import speedup

    return speedup(shape, c, spec, _micro_tokens(c, seq_len))


def compute_efficiency(
    shape: ModelShape,
    c: Candidate,
    seq_len: int,
    spec: GpuSpec,
    tokens_per_s: float,
    tf32: bool = True,
) -> float:
    """The stored efficiency that makes ``estimate`` predict ``tokens_per_s`` for this setup: the
    measured step minus the modelled optimizer step, over the peak, without fill and method factors.
    """
    rollout = rollout_seconds(shape, c, seq_len, spec)
    seq_len = c.sequence_tokens(seq_len)
    tokens = c.effective_batch * c.rows_per_example * seq_len
    step = tokens / tokens_per_s
    # A measurement faster than the optimizer model allows still leaves the compute some time.
    compute = max(step - optimizer_seconds(shape, c, spec) - rollout, 0.05 * step)
    peak = spec.peak_tflops(c.techniques.precision, tf32) * 1e12
    used = tokens * flops_per_token(shape, c, seq_len) / (peak * compute)
    fill = _fill(spec, _micro_tokens(c, seq_len))
    return used / (fill * method_factor(c) * fp8_factor(shape, c, seq_len, spec))


def assumptions(c: Candidate, spec: GpuSpec, calibrated: bool) -> tuple[str, ...]:
    t = c.techniques
    out = [] if calibrated else [default(spec, t.precision)[1]]
    half = HALF_FILL_TOKENS["cpu" if spec.key == "CPU" else "gpu"]
    out.append(f"micro-batch fill: half speed at {half} tokens")
    if t.compile != "off":
        out.append(
            f"compile x{COMPILE_SPEEDUP:.2f} speed (torchtune, Llama-3.2-3B on A100); compiled "
            "blocks keep no elementwise intermediates (min-cut partitioner; -14.9% peak there)"
        )
    if c.quantize_base != "none":
        out.append(
            f"4-bit base x{QLORA_SLOWDOWN:.2f} of LoRA speed (torchtune, Llama-3.2-3B on A100)"
        )
    if c.reference_kind == "precomputed":
        out.append(
            "DPO reference precomputed: one forward over the data before training, not in tokens/s"
        )
    if t.tiled_mlp != "off":
        out.append("tiled MLP: its forward once more per step (gate, up and down projections)")
    if t.fp8 != "off":
        from onegpu.plan.fp8 import ASSUMED

        out.append(ASSUMED)
    if c.training.objective == "grpo":
        out.append(
            f"GRPO sampling: decode at {DECODE_BANDWIDTH_SHARE:.0%} of the memory bandwidth, "
            "prefill at training's efficiency; tokens/s counts prompt and completion tokens"
        )
    if t.activation_offload:
        out.append(
            f"activation offload at {pcie_gbs(spec):.0f} GB/s per direction (PCIe gen "
            f"{PCIE_GEN.get(spec.key, 4)} x16 at {PINNED_COPY_EFFICIENCY:.0%}), overlapped with "
            "compute"
        )
    if t.offload != "none":
        out.append(
            f"PCIe {OFFLOAD_PCIE_GBS:.0f} GB/s, CPU Adam {CPU_ADAM_PARAMS_PER_S:.1e} params/s"
        )
    elif t.checkpointing == "offload":
        out.append(f"PCIe {OFFLOAD_PCIE_GBS:.0f} GB/s for offloaded activations")
    return tuple(out)


def _fill(spec: GpuSpec, tokens: int) -> float:
    half = HALF_FILL_TOKENS["cpu" if spec.key == "CPU" else "gpu"]
    return tokens / (tokens + half)


def _micro_tokens(c: Candidate, seq_len: int) -> int:
    """Tokens of one micro-batch through the model (a preference pair is two sequences)."""
    return c.training.micro_batch_size * c.rows_per_example * seq_len


def _prec_class(precision: str) -> str:
    return "16bit" if precision in ("fp16", "bf16", "bf16-pure") else "fp32"


def estimate(
    shape: ModelShape,
    c: Candidate,
    seq_len: int,
    spec: GpuSpec,
    tf32: bool = True,
    offloaded: float = 0.0,
) -> SpeedEstimate:
    """Predicted training throughput (tokens/s) of one setup on one GPU; ``offloaded``: the bytes
    of activations one micro-batch sends to the host (memory.MemoryEstimate.host_activations)."""
    precision = c.techniques.precision
    rollout = rollout_seconds(shape, c, seq_len, spec)
    seq_len = c.sequence_tokens(seq_len)  # GRPO: a row is a prompt and its completion
    eff, calibrated = base_efficiency(spec, precision)
    eff *= _fill(spec, _micro_tokens(c, seq_len)) * method_factor(c)
    eff *= fp8_factor(shape, c, seq_len, spec)
    fpt = flops_per_token(shape, c, seq_len)
    tokens = c.effective_batch * c.rows_per_example * seq_len  # a preference pair is two sequences
    compute = tokens * fpt / (spec.peak_tflops(precision, tf32) * 1e12 * eff)
    step = (
        compute
        + optimizer_seconds(shape, c, spec)
        + activation_offload_seconds(shape, c, seq_len)
        + offload_exposed_seconds(c, spec, compute, offloaded)
        + rollout
    )
    return SpeedEstimate(
        tokens / step, step, fpt, eff, calibrated, assumptions(c, spec, calibrated)
    )


def rollout_seconds(shape: ModelShape, c: Candidate, seq_len: int, spec: GpuSpec) -> float:
    """GRPO's sampling per step: the prompts' prefill (compute, at the same efficiency as
    training's forward: an assumption) and one decode step per completion token, bound by
    reading the weights and the KV cache at DECODE_BANDWIDTH_SHARE of the card's bandwidth; one
    batch of rollouts serves grpo.num_iterations steps."""
    if c.training.objective != "grpo":
        return 0.0
    from onegpu.plan.arch import forward_flops_per_token
    from onegpu.plan.memory import param_bytes, rollout_bytes

    # with tools, max_turns turns of decode (the prefix cache spares recomputing earlier turns)
    turns = c.grpo.max_turns if c.grpo.tools else 1
    rows, new = c.effective_batch, c.grpo.max_completion_length * turns
    eff = base_efficiency(spec, c.techniques.precision)[0] * method_factor(c)
    peak = spec.peak_tflops(c.techniques.precision) * 1e12
    prefill = rows * seq_len * forward_flops_per_token(shape, seq_len) / (peak * eff)
    weights = shape.params * param_bytes(c.techniques.precision)
    cache = rollout_bytes(shape, c, seq_len) / 2  # on average half written
    bandwidth = spec.bandwidth_gbs * 1e9 * DECODE_BANDWIDTH_SHARE
    return (prefill + new * (weights + cache) / bandwidth) / c.grpo.num_iterations


def activation_offload_seconds(shape: ModelShape, c: Candidate, seq_len: int) -> float:
    """checkpointing=offload: every layer's input (tokens x hidden, in the compute dtype) goes to
    pinned host memory in forward and comes back in backward, over PCIe (an assumed rate)."""
    if c.techniques.checkpointing != "offload":
        return 0.0
    dtype_bytes = 2 if c.techniques.precision in ("fp16", "bf16", "bf16-pure") else 4
    nbytes = 2 * c.effective_batch * seq_len * shape.hidden * shape.layers * dtype_bytes
    return nbytes / (OFFLOAD_PCIE_GBS * 1e9)


def pcie_gbs(spec: GpuSpec) -> float:
    """Pinned host<->device copy rate per direction, GB/s (see PCIE_GEN)."""
    return PCIE_LINK_GBS[PCIE_GEN.get(spec.key, 4)] * PINNED_COPY_EFFICIENCY


def offload_exposed_seconds(c: Candidate, spec: GpuSpec, compute: float, offloaded: float) -> float:
    """techniques.activation_offload: the saved activations cross PCIe once each way per
    micro-batch, on a side stream. Copies to the host overlap the forward (a third of the compute,
    2 of the 6 FLOPs per parameter), copies back the backward (the other two thirds); only what
    a copy takes beyond the compute it overlaps adds to the step. ``offloaded``: bytes one
    micro-batch moves (memory.MemoryEstimate.host_activations)."""
    if not c.techniques.activation_offload or spec.key == "CPU":
        return 0.0
    copy = offloaded * c.training.grad_accum / (pcie_gbs(spec) * 1e9)
    return max(0.0, copy - compute / 3) + max(0.0, copy - 2 * compute / 3)


def optimizer_seconds(shape: ModelShape, c: Candidate, spec: GpuSpec) -> float:
    """optimizer.step() is memory-bound: bytes read and written per parameter over the bandwidth;
    under ZeRO offload, gradients and weights cross PCIe and Adam runs on the host."""
    n = trainable_params(shape, c)
    opt = c.techniques.optimizer
    if c.techniques.offload != "none":
        return n * 4 / (OFFLOAD_PCIE_GBS * 1e9) + n / CPU_ADAM_PARAMS_PER_S
    per_param = {"sgd": 12, "adafactor": 12}.get(opt, 6 if "8bit" in opt or "4bit" in opt else 16)
    per_param += 4  # zeroing / clipping the gradients
    return n * per_param * 2 / (spec.bandwidth_gbs * 1e9)  # read + write
