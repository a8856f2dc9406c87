"""Autocast's cache of 16-bit weight copies: what a mixed-precision forward holds at its end.

Under ``torch.autocast`` the first cast of an fp32 leaf tensor that requires grad (a trained
weight) to the 16-bit compute dtype is cached, and later uses in the same autocast region reuse
that copy; the cache is emptied only when the outermost region exits (ATen's ``cached_cast`` in
autocast_mode.cpp, ``torch.autocast.__exit__``). Training runs the model's forward in one region
(Accelerate wraps ``forward``), so when the forward reaches its last block every trained weight a
matmul has read has its 16-bit copy alive. A block without checkpointing saves that copy for its
backward anyway (the matmul's input gradient reads it), so the measured activations count it; a
checkpointed block drops what it saved, and only the cache keeps its copies, until the forward
returns. The backward then starts without them, which is why this point only shows as the peak
where the backward's own is low: with the optimizer step in backward (no gradients held).

Measured on the simulated card (``tests/simgpu/fullsize.py``): the 1b preset, batch 2 x 4096, bf16
autocast over fp32 weights, full checkpointing, AdamW stepped in backward peaks at the last block's
MLP with 1.78 GiB of cached copies (15 of 16 down projections made so far), 14.35 GiB in all;
with ``torch.set_autocast_cache_enabled(False)`` 13.38 GiB. An H100 measured 14.41 GiB for the
same run (``/work/shared/gpu/h100-20261125``, ``docs/planner.md``).

Not cached, so not counted: frozen weights (LoRA's base: no ``requires_grad``), 16-bit weights
(``bf16-pure``: no cast), FP8's float8 layers (torchao casts their weights to float8 itself, a
copy freed after each matmul: checked on the simulated card, tests/simgpu) and compiled blocks,
whose casts are ops of the traced graph that run without autocast's dispatch, kept or freed as
the partitioner decides.
"""

from __future__ import annotations

from onegpu.plan.activation_model import checkpointed_layers
from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate
from onegpu.plan.fp8 import float8_params


def cached_cast_bytes(shape: ModelShape, c: Candidate, adapter_params: int = 0) -> float:
    """16-bit copies the cache holds at the forward's end beyond what the blocks save: those of
    the checkpointed blocks' trained Linear weights (with LoRA: the fp32 adapters'; with bf16
    adapters no cast is needed)."""
    t = c.techniques
    if t.precision not in ("fp16", "bf16") or t.compile != "off" or t.offload != "none":
        return 0.0
    n_ckpt = checkpointed_layers(shape.layers, t.checkpointing, t.checkpointing_every)
    if not n_ckpt or not shape.layers:
        return 0.0
    if c.lora_rank:
        trained = adapter_params if c.adapter_dtype != "bf16" else 0
    else:
        trained = shape.linear_params - float8_params(shape, c)
    return n_ckpt * trained / shape.layers * 2


def last_block_running_bytes(shape: ModelShape, mlp_tokens: int, act_bytes: int) -> float:
    """What the last block holds while its MLP runs under checkpointing (nothing is saved, so only
    what is in use): the activation, the up projection and their product (tokens x intermediate
    each) before the down projection reads the product; measured at full size on the simulated
    card (1b preset, 2 x 4096: 3 x 128 MiB at the peak)."""
    return 3 * mlp_tokens * shape.intermediate * act_bytes


def forward_end_bytes(
    shape: ModelShape,
    c: Candidate,
    kept: float,
    mlp_tokens: int,
    act_bytes: int,
    adapter_params: int = 0,
) -> float:
    """Activation bytes at the forward's end: what the forward keeps, the cache's copies and the
    last block's running MLP; 0 where the cache holds nothing beyond what the blocks save."""
    cached = cached_cast_bytes(shape, c, adapter_params)
    if not cached:
        return 0.0
    return kept + cached + last_block_running_bytes(shape, mlp_tokens, act_bytes)
