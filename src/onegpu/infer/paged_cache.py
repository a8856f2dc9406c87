"""The engine's KV cache on the device: one pool of fixed-size blocks per layer, and the view of it
that one forward reads and writes.

Each layer's keys (and values) are one tensor of ``num_blocks * block_size`` positions, head
major — ``[kv_heads, positions, head_dim]``, a block a run of ``block_size`` positions of each
head, as torch's FlexAttention paged attention lays out its pages — allocated at
the layer's first write (heads and head sizes differ between the layers of some families) and
only written in place, so its address never changes (a CUDA graph replays on fixed addresses).
Which positions belong to which sequence is the block tables' business (``kv_blocks.py``); a
forward is given where its new tokens go and what each of its rows reads (``PagedView``, the
cache object of that forward alone).

A forward's rows read their blocks as one gathered view ``[rows, kv_heads, kv_len, head_dim]``
(each row's head a contiguous ``[kv_len, head_dim]``, as SDPA's kernels read it):
the model's own attention (SDPA, eager, a soft cap, sinks, a sliding window — every family as
transformers writes it) then runs over it with the engine's 4D mask (``masks``). Eagerly the
gather is a copy of whole blocks; inside a compiled step inductor reads the blocks where they
are instead (``cpu_attention``). A prompt's first piece reads nothing older than itself: its
keys and values are handed on as the forward made them, with no gather.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from onegpu.infer import cpu_attention, gqa_attention


class PagedCache:
    """The pool of ``num_blocks`` blocks of ``block_size`` positions for every layer. A forward
    reads and writes it through the view it is given (``view``), never through state set on the
    pool beforehand."""

    def __init__(self, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size, self.dtype, self.device = (
            num_blocks,
            block_size,
            dtype,
            device,
        )
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.clean = 1  # blocks [0, clean) hold finite values (the null block from the start)
        self.gathered = 0  # rows whose blocks an eager forward gathered (EngineStats.kv_gathers)

    def reserve(self, blocks: int) -> None:
        """Blocks ``[0, blocks)`` are about to be used: zero those never used before. The pool
        is allocated empty, so memory is taken as blocks are first used (a CPU's budget of
        gigabytes is not written at start); a position is zeroed once, before anything reads it
        — a masked position still enters attention as 0 x value, which uninitialised memory (a
        NaN) would poison."""
        if blocks <= self.clean:
            return
        start, end = self.clean * self.block_size, blocks * self.block_size
        for pool in self.keys + self.values:
            pool[:, start:end].zero_()
        self.clean = blocks

    def view(self, write: Optional[torch.Tensor], tables=None, window=None) -> PagedView:
        """What one forward writes and reads, as the cache object the model's forward takes."""
        return PagedView(self, write, tables, window)

    def update(self, view: PagedView, key_states, value_states, layer_idx: int):
        """key/value ``[rows, kv_heads, query_len, head_dim]``: written at the view's positions;
        returned as the rows' gathered blocks (or as given, for a first piece)."""
        k, v = self._layer(layer_idx, key_states, value_states)
        if view.window is not None:  # the run's copy takes the writes
            return view.window.layer(layer_idx, key_states, value_states)
        k.index_copy_(1, view.write, _tokens(key_states, k.dtype))
        v.index_copy_(1, view.write, _tokens(value_states, v.dtype))
        if view.tables is None:
            return key_states, value_states
        if layer_idx == 0 and not torch.compiler.is_compiling():  # EngineStats.kv_gathers
            self.gathered += view.tables.shape[0]
        return self.gather(k, view.tables), self.gather(v, view.tables)

    def gather(self, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The blocks of each row, in order: ``[rows, kv_heads, blocks * block_size, dim]`` (a
        view of the gathered ``[kv_heads, rows, positions, dim]``)."""
        rows, blocks = tables.shape
        heads, dim = pool.shape[0], pool.shape[-1]
        by_block = pool.view(heads, self.num_blocks, self.block_size, dim)
        out = by_block.index_select(1, tables.reshape(-1))
        return out.view(heads, rows, blocks * self.block_size, dim).transpose(0, 1)

    def _layer(self, layer_idx: int, key_states, value_states):
        while len(self.keys) <= layer_idx:  # layers are written in order on the first forward
            if len(self.keys) != layer_idx:
                raise RuntimeError(f"PagedCache: layer {layer_idx} written before {len(self.keys)}")
            # each layer's pool where its keys are (layers split over devices by a device_map);
            # the blocks in use so far zeroed (reserve)
            positions, device = self.num_blocks * self.block_size, key_states.device
            for store, states in ((self.keys, key_states), (self.values, value_states)):
                shape = (states.shape[1], positions, states.shape[-1])
                store.append(torch.empty(shape, dtype=self.dtype, device=device))
                store[-1][:, : self.clean * self.block_size].zero_()
                if device.type == "cuda":  # fixed addresses: CUDA graphs replay without copies
                    torch._dynamo.mark_static_address(store[-1])
        return self.keys[layer_idx], self.values[layer_idx]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class PagedView(Cache):
    """The cache one forward is given: the pool, where its new tokens go (``write``: the pool
    position of each, ``[rows * query_len]`` in row order; None inside a DecodeWindow, whose copy
    takes the writes) and what its rows read (``tables``: each row's blocks ``[rows, kv_len /
    block_size]``; None: only their own new tokens, a prompt's first piece). Made for each
    forward: nothing of one forward's view outlives it."""

    def __init__(self, pool: PagedCache, write, tables=None, window=None):
        super().__init__(layers=[])
        self.pool, self.write, self.tables, self.window = pool, write, tables, window

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.pool.update(self, key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are passed explicitly; nothing reads this on the engine's path

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.pool.num_blocks * self.pool.block_size


def _as(x: torch.Tensor, dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _tokens(states: torch.Tensor, dtype) -> torch.Tensor:
    """``[rows, heads, query_len, dim]`` -> ``[heads, rows * query_len, dim]`` in the pool's
    dtype (a quantized model's activations may differ from the cache's)."""
    return _as(states.transpose(0, 1).reshape(states.shape[1], -1, states.shape[-1]), dtype)


def positions_in_pool(tables: torch.Tensor, positions: torch.Tensor, block_size: int):
    """Where each token of a row goes in the pool: its block (the row's table at position //
    block_size) times the block size plus the offset. ``tables [rows, blocks]``, ``positions
    [rows, query_len]`` -> ``[rows, query_len]``."""
    block = tables.gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return block * block_size + positions % block_size


def kv_bytes_per_position(model) -> int:
    """Bytes of K and V that one token takes in the cache, over all layers, measured: a one-token
    forward through a one-position pool (head counts and sizes differ by family: GQA, MLA)."""
    device = next(model.parameters()).device
    cache = PagedCache(1, 1, kv_dtype(model), device)
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            **{cache_kwarg(model): cache.view(torch.zeros(1, dtype=torch.long, device=device))},
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
    row; earlier queries of a piece are at the positions before it): causal, and windowed for
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
