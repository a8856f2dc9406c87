"""Eager decode steps over a contiguous copy of the decoding rows' KV, kept from run to run.

Eagerly, reading a row's blocks means gathering them (a copy of the row's whole KV) at every step;
the slot cache it replaces read a view. The window keeps a copy per row, ``[rows, kv_heads,
positions, head_dim]`` a layer: a row's copy is gathered from the pool once, when the row starts a
run with a sequence it did not hold in the last one (a newly decoding sequence: its prompt's KV),
and is kept up to date by the decode steps, which write their new token into the copy only; at
the end of each run the run's tokens go into the pool (``end``), before anything else reads them —
inside a run only decode steps run, and they read the copy. A step then costs what a slot-cache
step cost; the copy costs one gather a sequence and the memory of the decoding rows' KV a second
time (grown as they grow). Compiled steps do not use it: inductor reads the blocks where they lie.
A policy row (policy.py, ``eager_window``) with its measurements.
"""

from __future__ import annotations

from typing import Optional

import torch

from onegpu.infer.paged_cache import PagedCache, positions_in_pool


class DecodeWindow:
    def __init__(self, cache: PagedCache, max_rows: int, max_positions: int):
        """``max_rows`` rows of at most ``max_positions`` positions: the most a run can ask for,
        and what the copy grows to at most."""
        self.cache = cache
        self.max_rows, self.max_positions = max_rows, max_positions
        self.keys: list[torch.Tensor] = []  # a layer's copy, [row capacity, heads, length, dim]
        self.values: list[torch.Tensor] = []
        self.tables: Optional[torch.Tensor] = None  # this run's: [rows, blocks]
        self.start: Optional[torch.Tensor] = None  # each row's position at the run's start
        self.fresh: Optional[torch.Tensor] = None  # rows whose copy is gathered at this run's start
        self.positions: Optional[torch.Tensor] = None  # where the current step writes
        self.steps = 0
        self.rows: Optional[torch.Tensor] = None  # 0 .. rows - 1, for the steps' writes
        self.ready: set[int] = set()  # layers made ready for this run
        self.gathered = 0  # rows whose copy was gathered from the pool (EngineStats.kv_gathers)

    def begin(self, tables: torch.Tensor, positions: torch.Tensor, fresh: list[int]) -> None:
        """A run of the first ``tables.shape[0]`` rows over ``tables``' positions starts; the rows
        ``fresh`` hold sequences their copies do not."""
        self.tables, self.start = tables, positions.clone()
        self.fresh = torch.tensor(fresh, dtype=torch.long).to(tables.device) if fresh else None
        self.steps, self.ready = 0, set()

    def step(self, positions: torch.Tensor) -> None:
        self.positions, self.steps = positions, self.steps + 1
        if self.rows is None or self.rows.shape[0] != positions.shape[0]:
            self.rows = torch.arange(positions.shape[0], device=positions.device)

    def layer(self, layer_idx: int, key_states, value_states):
        """A decode step of layer ``layer_idx``: the new tokens into the copy; the copy's view of
        this run's rows and positions."""
        if layer_idx not in self.ready:
            self._prepare(layer_idx, key_states, value_states)
        rows, length = self.tables.shape[0], self.tables.shape[1] * self.cache.block_size
        out = []
        for store, states in ((self.keys, key_states), (self.values, value_states)):
            copy, new = store[layer_idx], states[:, :, 0]
            copy[self.rows, :, self.positions] = (
                new if new.dtype == copy.dtype else new.to(copy.dtype)
            )
            out.append(copy[:rows, :, :length])
        return out[0], out[1]

    def _prepare(self, layer_idx: int, key_states, value_states) -> None:
        """Room for this run's rows and positions (grown by doubling up to the engine's most, what
        is kept copied over); the fresh rows' blocks gathered from the pool."""
        rows, length = self.tables.shape[0], self.tables.shape[1] * self.cache.block_size
        pools = (self.cache.keys[layer_idx], self.cache.values[layer_idx])
        if self.fresh is not None and layer_idx == 0:  # a row's copy, every layer's, once
            self.gathered += self.fresh.shape[0]
        for store, states, pool in zip(
            (self.keys, self.values), (key_states, value_states), pools, strict=True
        ):
            if len(store) <= layer_idx:
                store.append(pool.new_zeros(0, states.shape[1], 0, states.shape[-1]))
            copy = store[layer_idx]
            if copy.shape[0] < rows or copy.shape[2] < length:
                # zeros: a padded step reads past a row's end, and 0 x NaN would poison it
                grown = copy.new_zeros(
                    max(rows, min(2 * copy.shape[0], self.max_rows)),
                    copy.shape[1],
                    max(length, min(2 * copy.shape[2], self.max_positions)),
                    copy.shape[3],
                )
                grown[: copy.shape[0], :, : copy.shape[2]] = copy
                store[layer_idx] = copy = grown
            if self.fresh is not None:
                tables = self.tables.index_select(0, self.fresh)
                copy[self.fresh, :, :length] = self.cache.gather(pool, tables)
        self.ready.add(layer_idx)

    def end(self, end: torch.Tensor) -> None:
        """The run's tokens from the copy into the pool: each row's positions ``[start, end)``
        (``end`` ``[rows]``: where each row stands after the run; a row that did not decode has
        end = start); what lies past a row's end goes to the null block."""
        if not self.keys or self.steps == 0:
            return
        size = self.cache.block_size
        offsets = torch.arange(self.steps, device=end.device)
        at = self.start[:, None] + offsets[None]  # [rows, steps]
        valid = at < end[:, None]
        at = torch.where(valid, at, 0).clamp_max(self.tables.shape[1] * size - 1)
        where = positions_in_pool(self.tables, at, size)
        where = torch.where(valid, where, at % size).reshape(-1)
        rows = torch.arange(at.shape[0], device=at.device)[:, None]
        for pool, copy in zip(
            self.cache.keys + self.cache.values, self.keys + self.values, strict=True
        ):
            tokens = copy[rows, :, at]  # [rows, steps, heads, dim]
            flat = tokens.permute(2, 0, 1, 3).reshape(pool.shape[0], -1, pool.shape[-1])
            pool.index_copy_(1, where, flat)
        self.tables = None
