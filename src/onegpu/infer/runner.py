"""The model runner: tensors in, logits out. A forward of some rows over the paged KV cache — a
decode step (one token a row) or prompt pieces (several tokens a row) — and the logits of each
row's last token. It owns the model's cache view and masks; it knows nothing of requests,
scheduling or sampling.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

from onegpu.infer import images, mrope
from onegpu.infer.decode_window import DecodeWindow
from onegpu.infer.images import PromptImages
from onegpu.infer.paged_cache import PagedCache, base_model, cache_kwarg, masks, positions_in_pool


@dataclass
class Pieces:
    """Prompt pieces of equal length, one a row: ``ids [rows, length]``, starting at ``starts``
    (host ints, the positions of each row's first token) with each row's block table ``tables
    [rows, blocks]`` covering its piece's end; ``adapters`` PEFT's per-row names or None."""

    ids: torch.Tensor
    starts: list[int]
    tables: torch.Tensor
    adapters: Optional[list[str]] = None
    images: Optional[PromptImages] = None
    """A lone piece's prompt images (infer/images.py): fed to the forward where it holds them."""
    deltas: Optional[torch.Tensor] = None
    """Each row's rotary offset past its KV positions (``Rows.rope_delta``; an mrope model's)."""


class ModelRunner:
    """Forwards of ``model`` over ``cache`` (the engine's pool) of at most ``max_rows`` rows of
    ``max_positions`` positions each."""

    def __init__(self, model, cache: PagedCache, max_rows: int, max_positions: int):
        self.model, self.cache = model, cache
        self.device = model.get_input_embeddings().weight.device
        self.kwarg = cache_kwarg(model)
        self.block_size = cache.block_size
        # a model trained with an MoE router loss keeps output_router_logits in its config, and
        # that loss would read the attention mask as a 2D padding mask
        self.no_router_loss = bool(getattr(model.config, "output_router_logits", False))
        self.window = DecodeWindow(cache, max_rows, max_positions)
        self.mrope = mrope.applies(model)  # rotary positions apart from KV slots (mrope.py)
        self.windowed = False  # inside decode_window
        self.prefills, self.prefill_tokens = 0, 0  # forwards of pieces and their positions

    @contextmanager
    def decode_window(self, tables: torch.Tensor, positions: torch.Tensor, fresh: list[int]):
        """Eager decode steps inside the block read and write the rows' copy of their KV
        (decode_window.py) over ``tables``' positions; ``fresh``: rows whose copy is gathered
        first; ``positions``: the rows' positions, which the steps advance. At the end the run's
        tokens go into the pool."""
        self.window.begin(tables, positions, fresh)
        self.windowed = True
        try:
            yield
        finally:
            self.windowed = False
            self.window.end(positions)

    def prefill(self, pieces: Pieces, every: bool = False) -> torch.Tensor:
        """Write the pieces' KV; the logits of each row's last token ``[rows, vocab]`` (fp32), or
        with ``every`` of each of its tokens ``[rows, length, vocab]`` (a prompt's logprobs)."""
        rows, length = pieces.ids.shape
        self.prefills, self.prefill_tokens = self.prefills + 1, self.prefill_tokens + rows * length
        starts = torch.tensor(pieces.starts).to(self.device)  # built on the host, then moved
        positions = starts[:, None] + torch.arange(length, device=self.device)[None]
        end = max(pieces.starts) + length
        fresh = max(pieces.starts) == 0  # nothing older to read: no gather
        tables = None if fresh else pieces.tables[:, : -(-end // self.block_size)]
        where = positions_in_pool(pieces.tables, positions, self.block_size)
        view = self.cache.view(where.reshape(-1), tables)
        kv_len = length if fresh else tables.shape[1] * self.block_size
        deltas = pieces.deltas if self.mrope else None
        logits = self._forward(
            view,
            pieces.ids,
            mrope.rotary(pieces.images, pieces.starts[0], positions, deltas),
            positions[:, -1],
            kv_len,
            length,
            pieces.adapters,
            every,
            prompt=(pieces.images, pieces.starts[0]),
        )
        return logits.float()

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        live: torch.Tensor,
        tables: torch.Tensor,
        adapters: Optional[list[str]] = None,
        model: Optional[torch.nn.Module] = None,
        deltas: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One token a row, a forward of ``model`` (the engine's copy of the model for its decode
        steps, decode_model.py; default the model as given): ``tokens``, ``positions``,
        ``live`` ``[rows]``, ``tables [rows, kv_len / block_size]`` -> logits ``[rows, vocab]``.
        A row that is not live writes into the null block (its table's first entry is 0 when it
        holds no sequence; a finished sequence's own blocks are not touched either). ``deltas``:
        an mrope model's rows' rotary offsets (mrope.py), None for the others."""
        # a row that does not decode may sit anywhere (a prompt being computed in pieces, a
        # finished sequence's last position): it reads its table at 0 and writes into block 0
        safe = torch.where(live, positions, 0)
        if self.windowed:  # the step writes into the run's copy only
            self.window.step(safe)
            view = self.cache.view(None, tables, self.window)
        else:
            where = positions_in_pool(tables, safe[:, None], self.block_size)[:, 0]
            where = torch.where(live, where, positions % self.block_size)
            view = self.cache.view(where, tables)
        kv_len = tables.shape[1] * self.block_size
        rotary = mrope.rotary(None, 0, positions[:, None], deltas)
        return self._forward(
            view, tokens[:, None], rotary, positions, kv_len, 1, adapters, model=model
        )

    def _forward(
        self,
        view,
        ids,
        rotary,
        last,
        kv_len: int,
        query_len: int,
        adapters,
        every=False,
        model=None,
        prompt=(None, 0),
    ):
        """``rotary``: the tokens' position_ids (their KV positions but for mrope); ``last``: each
        row's last KV position (the masks'); ``prompt``: a prompt piece's images and start (the
        image tensors it feeds, and for Gemma 3 its image tokens attending both ways)."""
        model = self.model if model is None else model
        config = model.config.get_text_config()  # a vision-language model's: its language model's
        mask = masks(config, last, kv_len, self.cache.dtype, config._attn_implementation, query_len)
        mask = images.bidirectional(mask, *prompt, query_len)
        kw = {} if adapters is None else {"adapter_names": adapters}
        kw.update(images.model_inputs(*prompt, self.device, self.cache.dtype))
        if self.no_router_loss:
            kw["output_router_logits"] = False
        out = model(
            input_ids=ids,
            position_ids=rotary,
            attention_mask=mask,
            **{self.kwarg: view},
            use_cache=True,
            logits_to_keep=0 if every else 1,
            **kw,
        )
        return out.logits if every else out.logits[:, -1]

    @property
    def base(self):
        return base_model(self.model)
