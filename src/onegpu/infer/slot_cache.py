"""The decode engine's KV cache: one row ("slot") per running sequence, each at its own position.

transformers' StaticCache writes every row of a batch at one shared position, so a sequence cannot
join a batch that is already decoding. Here each slot keeps its own length: a prefill writes one
slot's prompt, a decode step writes each slot's new token at that slot's position (one
``index_put_``), and attention reads the first ``kv_len`` positions of the first ``rows`` slots — a
view, no copy. What a slot may see is the engine's 4D mask (``masks``), which transformers' models
take as given. The tensors are allocated once (per layer, at its first write: heads and head sizes
differ between layers of some families) and only written in place, so their addresses never change
— what a CUDA graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from transformers.cache_utils import Cache

from onegpu.infer import cpu_attention, gqa_attention


@dataclass
class _Prefill:
    slot: int
    length: int


@dataclass
class _Decode:
    rows: int
    positions: torch.Tensor  # [rows] where each slot writes its token
    kv_len: int


class SlotCache(Cache):
    """``slots`` sequences of at most ``max_len`` positions each. The engine sets what the next
    forward writes (``prefill`` or ``decode``) before calling the model."""

    def __init__(self, slots: int, max_len: int, dtype: torch.dtype, device):
        super().__init__(layers=[])
        self.slots, self.max_len, self.dtype, self.device = slots, max_len, dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mode: Union[_Prefill, _Decode, None] = None

    def prefill(self, slot: int, length: int) -> None:
        self.mode = _Prefill(slot, length)

    def decode(self, rows: int, positions: torch.Tensor, kv_len: int) -> None:
        self.mode = _Decode(rows, positions, kv_len)

    def sharing(self) -> SlotCache:
        """Another cache over the same tensors (the same lists: a layer allocated through either
        is the other's too) with a mode of its own, for a prefill on another thread."""
        other = SlotCache(self.slots, self.max_len, self.dtype, self.device)
        other.keys, other.values = self.keys, self.values
        return other

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Give slot ``dst`` the first ``length`` positions of ``src`` (a shared prompt's KV)."""
        for k, v in zip(self.keys, self.values, strict=True):
            k[dst, :, :length].copy_(k[src, :, :length])
            v[dst, :, :length].copy_(v[src, :, :length])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        k, v = self._layer(layer_idx, key_states, value_states)
        mode = self.mode
        if isinstance(mode, _Prefill):
            end = mode.length
            k[mode.slot, :, :end] = key_states[0]
            v[mode.slot, :, :end] = value_states[0]
            return k[mode.slot : mode.slot + 1, :, :end], v[mode.slot : mode.slot + 1, :, :end]
        assert isinstance(mode, _Decode), "SlotCache: the engine sets prefill or decode first"
        rows = torch.arange(mode.rows, device=k.device)
        k[rows, :, mode.positions] = key_states[:, :, 0]
        v[rows, :, mode.positions] = value_states[:, :, 0]
        return k[: mode.rows, :, : mode.kv_len], v[: mode.rows, :, : mode.kv_len]

    def _layer(self, layer_idx: int, key_states, value_states):
        while len(self.keys) <= layer_idx:  # layers are written in order on the first forward
            if len(self.keys) != layer_idx:
                raise RuntimeError(f"SlotCache: layer {layer_idx} written before {len(self.keys)}")
            # each layer's cache where its keys are (layers split over devices by a device_map)
            shape, device = (self.slots, key_states.shape[1], self.max_len), key_states.device
            self.keys.append(
                torch.zeros(*shape, key_states.shape[-1], dtype=self.dtype, device=device)
            )
            self.values.append(
                torch.zeros(*shape, value_states.shape[-1], dtype=self.dtype, device=device)
            )
            if device.type == "cuda":  # fixed addresses: CUDA graphs replay without copies
                torch._dynamo.mark_static_address(self.keys[-1])
                torch._dynamo.mark_static_address(self.values[-1])
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are passed explicitly; nothing reads this on the engine's path

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_len

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def kv_bytes_per_position(model) -> int:
    """Bytes of K and V that one token takes in the cache, over all layers, measured: a one-token
    forward through a one-slot cache (head counts and sizes differ by family: GQA, MLA)."""
    device = next(model.parameters()).device
    cache = SlotCache(1, 1, kv_dtype(model), device)
    cache.prefill(0, 1)
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            **{cache_kwarg(model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    return cache.bytes


def kv_dtype(model) -> torch.dtype:
    """The dtype the cache stores: the model's compute dtype (a quantized model computes in its
    non-quantized parameters' dtype)."""
    floats = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    return floats[0] if floats else torch.float32


def base_model(model):
    """The transformers model under a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_kwarg(model) -> str:
    """transformers renamed the forward's ``past_key_values`` to ``cache`` (5.24; the old name
    warns); pass the name this version's model takes."""
    import inspect

    params = inspect.signature(base_model(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def masks(config, positions: torch.Tensor, kv_len: int, dtype, attn: str, query_len: int = 1):
    """The attention mask of each layer type for queries at ``positions`` (the last query of each
    row; earlier queries of a prefill are at the positions before it): causal, and windowed for
    sliding-window layers. Bool for SDPA and the engine's own decode attentions (True = attend),
    additive for eager kernels. A model whose layers differ (``layer_types``) takes a dict by
    layer type; others one tensor."""
    kv = torch.arange(kv_len, device=positions.device)
    q = positions[:, None] - torch.arange(query_len - 1, -1, -1, device=positions.device)[None]
    allowed = kv[None, None, :] <= q[:, :, None]  # [rows, query_len, kv_len]

    def finish(window: Optional[int]):
        m = allowed if not window else allowed & (kv[None, None, :] > q[:, :, None] - window)
        m = m[:, None]
        if attn in ("sdpa", gqa_attention.NAME, cpu_attention.NAME):
            return m
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(
            ~m, torch.finfo(dtype).min
        )

    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {
            kind: finish(window if kind == "sliding_attention" else None)
            for kind in set(layer_types)
        }
    return finish(window)
