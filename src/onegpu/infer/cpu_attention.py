"""A compiled CPU decode step's attention as inductor's own loops instead of SDPA's kernel.

A decode step has one query per row. PyTorch's CPU SDPA (its flash kernel) runs it as two small
GEMM calls per (row, head, block of 512 positions) — a [1, D] x [D, 512] product, then [1, 512] x
[512, D] — and at 16 rows over 640 positions (the tiny preset, fp32, 2 threads) takes 0.88 ms a
layer to read 10.5 MB of keys and values that a plain sum reads in 0.54. Written as the softmax it
is — scores as a sum over the head dimension, the row's maximum, exponentials, their sum, the
weighted sum of the values — inductor fuses it into a few C++ loops over the cache that read each
key and value once. Only inside a compiled step: eagerly the same ops would build a [rows, heads,
positions, head_dim] product in memory, so an eager call (a step with LoRA adapters routes
through PEFT's hooks eagerly) goes to SDPA. Timed in benchmarks/results/engine-cpu-attention.md;
when it is used is a row of the engine's policy table (policy.py). Over the paged cache its keys
and values are the rows' gathered blocks, which inductor reads where they lie in the pool
(paged_cache.py): the gather is a load of the loop, not a copy.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch._prims_common import make_contiguous_strides_for

NAME = "onegpu_cpu_decode"


def decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed, scale: float
) -> torch.Tensor:
    """query [B, H, 1, D], key/value [B, KVH, L, D] (H a multiple of KVH), ``allowed`` None or a
    bool [B, 1, 1, L] (True = attend) or an additive float mask of that shape -> [B, 1, H, D].

    The G query heads of a key head read that head's keys where they are (no repeat_kv copy).
    Computed in fp32 whatever the cache's dtype, as SDPA's CPU kernel accumulates."""
    b, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.float().reshape(b, kv_heads, heads // kv_heads, 1, dim)
    if torch.compiler.is_compiling():
        # the query as a buffer of its own: inside the score loop inductor would otherwise
        # recompute what makes it (its rotary embedding, cos and sin included) at every key
        # position, not once (a step's time: engine-decode-compiled-cpu.md). inductor's layout
        # prim (its module imported by register: an import here would break the graph)
        force = torch.ops.prims.inductor_force_stride_order
        q = force(q, make_contiguous_strides_for(q.shape))
    scores = (q * key.float()[:, :, None]).sum(-1) * scale  # [B, KVH, G, L]
    if allowed is not None:
        m = allowed.reshape(b, 1, 1, length)
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    top = scores.amax(-1, keepdim=True)
    # a row with nothing to attend (an empty slot's) gets zeros, not NaN from -inf - -inf
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = (weights[..., None] * value.float()[:, :, None]).sum(-2)  # [B, KVH, G, D]
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)
    return out.reshape(b, 1, heads, dim).to(query.dtype)


def wanted(query: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> bool:
    """This path, for a decode call on a CPU inside a compiled step with one mask for all heads."""
    shared = attention_mask is None or attention_mask.shape[1] == 1
    return (
        query.device.type == "cpu"
        and query.shape[2] == 1
        and shared
        and torch.compiler.is_compiling()
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. A plain decode call of a compiled CPU step: ``decode``;
    anything else (eager, a prefill, a soft cap...): the engine's GQA function, which hands what
    it does not take to transformers' SDPA."""
    from onegpu.infer import gqa_attention

    grouped = query.shape[1] % key.shape[1] == 0
    if grouped and gqa_attention.plain(dropout, kwargs) and wanted(query, attention_mask):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode(query, key, value, attention_mask, scale), None
    return gqa_attention.attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register(compiled: bool = False) -> None:
    """The attention function, and transformers' SDPA mask maker under the same name, in
    transformers' registry: before the engine's copy of a model names it (decode_model.py); for a
    compiled step also inductor's layout prim (importing inductor takes seconds: only then)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if compiled:
        importlib.import_module("torch._inductor.inductor_prims")  # registers torch.ops.prims'
