"""Grouped-query attention in the engine's decode steps without ``repeat_kv``'s copy.

transformers' SDPA function gives a GQA model (fewer key/value heads than query heads) SDPA's own
GQA only without a mask; with one — every engine step has one, its rows sit at different lengths
— it copies each layer's keys and values once per query head of a group (``repeat_kv``) before
SDPA reads the copies: on the 1b preset (32 query heads over 8 key heads) 4x the KV cache written
and read again each step. transformers 5.24 packs the queries instead outside torch.compile only,
5.17 (the card's) never.

A decode step has one query token per row, so the G query heads of a key head can stand in for G
query tokens of that head: ``[B, H, 1, D] -> [B, KVH, G, D]``, one SDPA call over the cache as it
is, the row's mask broadcast over the G "tokens" (they attend to the same positions), the output
reshaped back. The engine's own copy of a GQA model that runs SDPA names this function
(decode_model.py), for its decode steps only (the prefill runs on the model as given); anything
else it is handed — several query tokens, a per-head mask, dropout, a soft cap, sinks, a position
bias — goes to transformers' SDPA function unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

NAME = "onegpu_gqa_decode"


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
    """transformers' attention signature: query [B, H, 1, D], key/value [B, KVH, L, D] ->
    ([B, 1, H, D], None)."""
    b, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    packs = q_len == 1 and kv_heads < heads and heads % kv_heads == 0
    if not (packs and shared_mask and plain(dropout, kwargs)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(b, kv_heads, heads // kv_heads, query.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def plain(dropout: float, kwargs: dict) -> bool:
    """No dropout, soft cap, attention sinks or position bias: SDPA's own arguments cover it."""
    return not dropout and all(
        kwargs.get(k) is None for k in ("softcap", "s_aux", "sinks", "position_bias")
    )


def applies(model) -> bool:
    """A model that attends with SDPA and has fewer key/value heads than query heads."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    grouped = isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads < heads
    return grouped and sdpa(model)


def sdpa(model) -> bool:
    """A model that attends with SDPA (transformers' function, which the engine's replace)."""
    return getattr(model.config, "_attn_implementation", None) == "sdpa"


def register() -> None:
    """The attention function, and transformers' SDPA mask maker under the same name (a model
    that builds its own mask looks it up by the implementation's name), in transformers' registry:
    before the engine's copy of a model names it (decode_model.py)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
