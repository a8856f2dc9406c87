"""FP8 in the planner: which Linear layers run in float8, what they save, and how fast they are.

Speed, per Linear layer, as torchao's roofline script estimates it (``benchmarks/float8/
float8_roofline.py`` over ``torchao/testing/training/roofline_utils.py``): each of the layer's
three matmuls (output M x K x N, input gradient M x N x K, weight gradient K x M x N) takes the
longer of its FLOPs at the card's peak (bf16, or FP8 from the catalogue: hardware.GpuSpec) and
its bytes at the card's bandwidth, each at the share of peak torchao measured on an H100; FP8 adds
the casts of the input, the weight and the output gradient to float8 (torchao's kernel-by-kernel
bytes for each recipe, a launch's time at least per kernel). That is compiled code, whose casts
are fused into a few kernels. Eager code runs torchao's casts op by op: their bytes are counted
from the ops torchao really runs, traced on the meta device at the layer's shapes
(``eager_cast_seconds``). A weight read in fp32 (mixed precision's master weights) is cast from 4
bytes, not 2.

The layers: the rule (techniques/fp8.rule: not the head, both dimensions multiples of 16) and then
the planner: a layer whose float8 time at the micro-batch's tokens is not below its bf16 time is
written to ``techniques.fp8_skip`` (``choose_skip``). The step: the planner's compute time, scaled
on the float8 layers' share of the FLOPs by their roofline time ratio (``speedup``).

Memory: what float8 layers keep for backward is measured (plan/activations.py builds its measuring
model with them); here only the layers' weight elements (``float8_params``), which autocast no
longer copies to 16 bits (plan/autocast_cache.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from onegpu.hardware import GpuSpec
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate

# torchao's roofline constants for an H100 (roofline_utils.gpu_name_to_specs, "NVIDIA H100"):
# share of the peak a large matmul reaches, share of the bandwidth a large cast kernel reaches,
# and a kernel's launch time. Assumptions for every other card: listed where used.
GEMM_SHARE = 0.78
BANDWIDTH_SHARE = 0.92
LAUNCH_S = 2e-6
TC_MULTIPLE = 16  # techniques/fp8.TC_MULTIPLE
ASSUMED = (
    f"fp8 per layer: torchao's roofline (matmuls at {GEMM_SHARE:.0%} of the bf16/FP8 peak, casts "
    f"at {BANDWIDTH_SHARE:.0%} of the bandwidth, {LAUNCH_S * 1e6:.0f} us a kernel: torchao's H100 "
    "figures)"
)

# Compiled casts, torchao's kernels (roofline_utils.get_tensor_memory_traffic_ovhd_s, no fusion
# with the op before): per role, each kernel's bytes per element as (high-precision reads, float8
# writes); kernels with no modelled traffic still cost a launch.
CAST_KERNELS = {
    "tensorwise": {
        "input": ((1, 0), (0, 0), (1, 2)),
        "weight": ((1, 0), (0, 0), (1, 1), (1, 1)),
        "grad_output": ((1, 0), (0, 0), (1, 2)),
    },
    "rowwise": {
        "input": ((2, 1), (1, 1)),
        "weight": ((1, 1), (2, 0), (1, 1)),
        "grad_output": ((2, 1), (1, 1)),
    },
    "rowwise-gw-hp": {
        "input": ((1, 1),),
        "weight": ((1, 1), (0, 0), (1, 1)),
        "grad_output": ((1, 1),),
    },
}


@dataclass(frozen=True)
class LayerTimes:
    """One Linear layer's seconds per call, bf16 and float8: forward, backward."""

    bf16_fwd: float
    bf16_bwd: float
    fp8_fwd: float
    fp8_bwd: float

    def ratio(self, recompute: float = 0.0) -> float:
        """float8 over bf16 time for a step, ``recompute`` of the forwards run again."""
        bf16 = (1 + recompute) * self.bf16_fwd + self.bf16_bwd
        return ((1 + recompute) * self.fp8_fwd + self.fp8_bwd) / bf16


def gemm_seconds(spec: GpuSpec, m: int, k: int, n: int, fp8: bool) -> float:
    """One matmul: the longer of its FLOPs at the peak and its bytes at the bandwidth (float8
    operands read 1 byte, the 16-bit output is written 2)."""
    peak = spec.peak_tflops("fp8" if fp8 else "bf16") * 1e12 * GEMM_SHARE
    operand = 1 if fp8 else 2
    nbytes = (m * k + k * n) * operand + m * n * 2
    return max(
        2 * m * k * n / peak, nbytes / (spec.bandwidth_gbs * 1e9 * BANDWIDTH_SHARE), LAUNCH_S
    )


def cast_seconds(spec: GpuSpec, recipe: str, role: str, numel: int, hp_bytes: int) -> float:
    """A role's float8 casts in compiled code (CAST_KERNELS), each kernel at least a launch."""
    bandwidth = spec.bandwidth_gbs * 1e9 * BANDWIDTH_SHARE
    return sum(
        max(numel * (reads * hp_bytes + writes) / bandwidth, LAUNCH_S)
        for reads, writes in CAST_KERNELS[recipe][role]
    )


def layer_times(
    spec: GpuSpec, recipe: str, m: int, k: int, n: int, weight_bytes: int, frozen: bool, eager: bool
) -> LayerTimes:
    """bf16 and float8 seconds of one Linear layer (M tokens, K in, N out) per forward and
    backward. A frozen weight (LoRA's base) needs no weight gradient in bf16; torchao's eager
    autograd function computes it anyway (compiled code drops it)."""
    gw_fp8 = recipe != "rowwise-gw-hp"
    bf16_bwd = gemm_seconds(spec, m, n, k, False) + (
        0 if frozen else gemm_seconds(spec, k, m, n, False)
    )
    fp8_bwd = gemm_seconds(spec, m, n, k, True)
    if not frozen or eager:
        fp8_bwd += gemm_seconds(spec, k, m, n, gw_fp8)
    if eager:
        fwd_cast, bwd_cast = eager_cast_seconds(spec, recipe, m, k, n, weight_bytes)
    else:
        fwd_cast = cast_seconds(spec, recipe, "input", m * k, 2)
        fwd_cast += cast_seconds(spec, recipe, "weight", k * n, weight_bytes)
        bwd_cast = cast_seconds(spec, recipe, "grad_output", m * n, 2)
    return LayerTimes(
        gemm_seconds(spec, m, k, n, False),
        bf16_bwd,
        gemm_seconds(spec, m, k, n, True) + fwd_cast,
        fp8_bwd + bwd_cast,
    )


def eager_cast_seconds(
    spec: GpuSpec, recipe: str, m: int, k: int, n: int, weight_bytes: int
) -> tuple[float, float]:
    """(forward, backward) seconds of torchao's casts run op by op, from its ops' bytes."""
    bandwidth = spec.bandwidth_gbs * 1e9 * BANDWIDTH_SHARE
    fwd, bwd = _traced_cast_bytes(recipe, m, k, n, weight_bytes)
    return (
        sum(max(b / bandwidth, LAUNCH_S) for b in fwd),
        sum(max(b / bandwidth, LAUNCH_S) for b in bwd),
    )


@functools.lru_cache(maxsize=256)
def _traced_cast_bytes(recipe: str, m: int, k: int, n: int, weight_bytes: int):
    """The bytes each op of torchao's float8 Linear reads and writes besides its matmuls, forward
    and backward, traced on the meta device (no memory, no compute) with a 16-bit input and a
    weight of ``weight_bytes`` per element."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

    from onegpu.config import TechniquesConfig
    from onegpu.techniques.fp8 import apply_fp8

    ops: list = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [*torch.utils._pytree.tree_leaves((args, kwargs)), out]
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            if not func.is_view and not any(is_traceable_wrapper_subclass(t) for t in tensors):
                ops.append(sum(t.numel() * t.element_size() for t in tensors))
            return out

    dtype = torch.float32 if weight_bytes == 4 else torch.bfloat16
    layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="meta", dtype=dtype))
    quiet = logging.getLogger("onegpu.techniques.fp8")  # a trace, not a run: no start-up line
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        apply_fp8(layer, TechniquesConfig(fp8=recipe, fp8_emulate=True))
    finally:
        quiet.setLevel(level)
    x = torch.empty(m, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with Count():
        y = layer(x)
    fwd, ops[:] = list(ops), []
    with Count():
        y.backward(torch.empty_like(y))
    return tuple(fwd), tuple(ops)


def eligible(shape: ModelShape) -> list[tuple[str, int, int, int]]:
    """The decoder's Linear layers the rule lets run in float8: (name, in, out, count)."""
    return [x for x in shape.linears if x[1] % TC_MULTIPLE == 0 and x[2] % TC_MULTIPLE == 0]


def float8_layers(shape: ModelShape, skip: str) -> list[tuple[str, int, int, int]]:
    names = {s.strip() for s in skip.split(",") if s.strip()}
    return [x for x in eligible(shape) if x[0] not in names]


def float8_params(shape: ModelShape, c: Candidate) -> int:
    """Weight elements of the setup's float8 layers (0 without FP8)."""
    if c.techniques.fp8 == "off":
        return 0
    return sum(k * n * count for _, k, n, count in float8_layers(shape, c.techniques.fp8_skip))


def cast_transient_bytes(shape: ModelShape, c: Candidate, tokens: int) -> float:
    """Bytes eager float8 layers hold beyond the rest while a block's backward runs: torchao casts
    each layer's saved input to float8 again for its weight gradient, op by op (the input scaled,
    then clamped, in its own dtype, then the float8 copy), the largest at the widest input.
    Compiled code fuses the cast into one kernel: nothing of this size."""
    from onegpu.plan.transients import act_bytes

    if c.techniques.fp8 == "off" or c.techniques.compile != "off":
        return 0.0
    widest = max((k for _, k, _, _ in float8_layers(shape, c.techniques.fp8_skip)), default=0)
    return (2 * act_bytes(c) + 1) * tokens * widest


def _times(shape: ModelShape, c: Candidate, spec: GpuSpec, tokens: int, layer) -> LayerTimes:
    from onegpu.plan.transients import param_bytes

    t = c.techniques
    _, k, n, _ = layer
    frozen = bool(c.lora_rank)  # LoRA's base: stored in the weights' dtype, as trained ones are
    weight_bytes = param_bytes(t.precision)
    return layer_times(spec, t.fp8, tokens, k, n, weight_bytes, frozen, t.compile == "off")


def choose_skip(shape: ModelShape, c: Candidate, spec: GpuSpec, tokens: int) -> str:
    """techniques.fp8_skip for a setup: every layer name whose float8 time over the step (forward,
    backward, a checkpointed forward again) is not below its bf16 time at ``tokens`` per call."""
    recompute = _recompute(shape, c)
    slower = {
        x[0] for x in eligible(shape) if _times(shape, c, spec, tokens, x).ratio(recompute) >= 1
    }
    return ",".join(sorted(slower))


def speedup(shape: ModelShape, c: Candidate, spec: GpuSpec, tokens: int) -> float:
    """The step's compute speed with the setup's float8 layers over the same step in bf16: their
    share of the FLOPs (the weight matmuls: 6 per weight and token, 4 for a frozen one, 2 more
    for a recomputed forward) runs at their roofline ratio, the rest as before."""
    from onegpu.plan.arch import flops_per_token

    layers = float8_layers(shape, c.techniques.fp8_skip) if c.techniques.fp8 != "off" else []
    if not layers or not spec.fp8:
        return 1.0
    recompute = _recompute(shape, c)
    per_weight = (4 if c.lora_rank else 6) + 2 * recompute
    seq = tokens // max(c.training.micro_batch_size * c.rows_per_example, 1)
    total = flops_per_token(shape, seq, c.lora_rank, recompute, c.techniques.lora.targets)
    share, scaled = 0.0, 0.0
    for layer in layers:
        part = per_weight * layer[1] * layer[2] * layer[3] / total
        share += part
        scaled += part * _times(shape, c, spec, tokens, layer).ratio(recompute)
    return 1.0 / (1.0 - share + scaled)


def _recompute(shape: ModelShape, c: Candidate) -> float:
    from onegpu.plan.activation_model import checkpointed_layers

    t = c.techniques
    return checkpointed_layers(shape.layers, t.checkpointing, t.checkpointing_every) / max(
        shape.layers, 1
    )


def gain(rows: list, spec: GpuSpec, shape: ModelShape) -> dict | None:
    """FP8's predicted gain in a plan (``search.Plan.rows``): the fastest fitting float8 setup
    against the same setup in bf16, whether the plan chose it, and its layers. None where the plan
    has no float8 setup (a card without FP8 tensor cores, or techniques.fp8=off)."""
    import dataclasses

    fitting = [r for r in rows if r.fits]
    fp8 = next((r for r in fitting if r.candidate.techniques.fp8 != "off"), None)
    if fp8 is None:
        return None
    c = fp8.candidate
    plain = dataclasses.replace(c.techniques, fp8="off", fp8_skip="")
    twin = next((r for r in fitting if r.candidate.techniques == plain), None)
    layers = float8_layers(shape, c.techniques.fp8_skip)
    total = sum(x[3] for x in shape.linears)
    return {
        "recipe": c.techniques.fp8,
        "setup": c.label(),
        "ratio": fp8.speed.tokens_per_s / twin.speed.tokens_per_s if twin else None,
        "chosen": bool(fitting) and fitting[0] is fp8,
        "float8_layers": sum(x[3] for x in layers),
        "linear_layers": total,
        "skipped": c.techniques.fp8_skip,
        "memory_ratio": fp8.memory.peak / twin.memory.peak if twin else None,
    }


def gain_line(g: dict | None, spec: GpuSpec) -> str:
    """One line for `onegpu plan`: FP8's predicted gain on this card, and whether it was chosen."""
    if g is None:
        if not spec.fp8:
            return f"fp8: {spec.name} has no FP8 tensor cores"
        return "fp8: not planned (techniques.fp8=off, or no setup with float8 layers fits)"
    ratio = f"{g['ratio']:.2f}x the tokens/s" if g["ratio"] else "no bf16 twin to compare"
    mem = f", {g['memory_ratio']:.2f}x the peak memory" if g["memory_ratio"] else ""
    skipped = f"; kept in bf16 (slower in float8): {g['skipped']}" if g["skipped"] else ""
    verdict = "chosen" if g["chosen"] else "not chosen: a setup without it is faster"
    return (
        f"fp8 ({g['recipe']}): predicted {ratio} of the same setup in bf16{mem} "
        f"({g['float8_layers']} of {g['linear_layers']} decoder Linear layers in float8{skipped}); "
        f"{verdict}"
    )
