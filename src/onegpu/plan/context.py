"""The longest context one GPU trains: per setup, the longest sequence that fits at batch 1.

A ladder of setups on the user's config (its method, LoRA/QLoRA and optimizer as configured, the
GPU's compute precision), each adding one technique to the one before, so the table shows what
each contributes: plain (no checkpointing, the plain loss), + checkpointing, + the fused loss,
+ tiled MLP, + activation offload. For each, a bisection over the sequence length with the memory
model (memory.estimate, the same prediction `onegpu plan` ranks by) finds the longest length that
fits, and the speed model its tokens/s there.
"""

from __future__ import annotations

from dataclasses import dataclass

from onegpu.config import Config
from onegpu.hardware import GpuSpec
from onegpu.plan import memory, speed
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate, setup

MIN_SEQ = 64  # shorter than this is not a context worth reporting
MAX_SEQ = 1 << 24  # the bisection's ceiling (16M tokens)
# (label, the techniques it adds to the setup before it)
LADDER = (
    ("plain: no checkpointing, plain loss", {}),
    ("+ checkpointing (full)", {"checkpointing": "full"}),
    ("+ fused loss", {"loss": "fused"}),
    ("+ tiled MLP", {"tiled_mlp": "on"}),
    ("+ activation offload", {"activation_offload": True}),
)


@dataclass
class Longest:
    label: str
    candidate: Candidate
    seq_len: int  # 0: not even MIN_SEQ tokens fit
    memory: memory.MemoryEstimate | None
    speed: speed.SpeedEstimate | None


def ladder(cfg: Config, spec: GpuSpec, shape: ModelShape) -> list[tuple[str, Candidate]]:
    """The setups of the table, batch 1, on cfg's method and optimizer."""
    from onegpu.plan.search import loss_chunk, precisions

    on_gpu = spec.key != "CPU"
    t = cfg.techniques
    base = {
        "precision": precisions(spec, t.precision)[0],
        "compile": "off",
        "offload": "none",
        "checkpointing": "off",
        "loss": "plain",
        "loss_chunk_size": 0,
        "tiled_mlp": "off",
        "activation_offload": False,
    }
    fused = {
        "loss": "fused",
        "loss_chunk_size": loss_chunk(cfg, shape.vocab, on_gpu, "none") or 0,
    }
    out, techniques = [], dict(base)
    for label, adds in LADDER:
        if adds.get("activation_offload") and not on_gpu:
            continue  # activations already live in host memory
        if adds.get("tiled_mlp") == "on" and (shape.experts or not shape.intermediate):
            continue  # MoE blocks are not tiled (techniques/tiled_mlp.py)
        techniques.update(fused if adds.get("loss") == "fused" else adds)
        out.append((label, setup(1, 1, cfg, **techniques)))
    return out


def longest(
    shape: ModelShape,
    c: Candidate,
    spec: GpuSpec,
    capacity: float,
    attention: str = "sdpa",
    tf32: bool = True,
) -> int:
    """The longest sequence (tokens, batch 1) whose predicted peak fits in ``capacity`` bytes."""
    on_gpu = spec.key != "CPU"

    def fits(seq: int) -> bool:
        return memory.estimate(shape, c, seq, on_gpu=on_gpu, attention=attention).fits(capacity)

    if not fits(MIN_SEQ):
        return 0
    lo, hi = MIN_SEQ, MIN_SEQ * 2
    while hi < MAX_SEQ and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= MAX_SEQ and fits(MAX_SEQ):
        return MAX_SEQ
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_context(
    cfg: Config,
    spec: GpuSpec,
    shape: ModelShape,
    capacity_gib: float | None = None,
    attention: str = "sdpa",
) -> list[Longest]:
    """Per setup of the ladder, the longest sequence that fits and its predicted speed."""
    capacity = (capacity_gib or spec.memory_gib) * 2**30
    tf32 = cfg.techniques.tf32 if cfg.techniques.tf32 is not None else True
    out = []
    for label, c in ladder(cfg, spec, shape):
        seq = longest(shape, c, spec, capacity, attention, tf32)
        if not seq:
            out.append(Longest(label, c, 0, None, None))
            continue
        mem = memory.estimate(shape, c, seq, on_gpu=spec.key != "CPU", attention=attention)
        out.append(
            Longest(
                label,
                c,
                seq,
                mem,
                speed.estimate(shape, c, seq, spec, tf32, mem.host_activations),
            )
        )
    return out
