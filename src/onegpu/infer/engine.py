"""The decode engine: what ``onegpu generate``, ``onegpu bench infer``, GRPO's rollouts and
``onegpu serve`` generate with.

Requests wait in a queue; each engine ``step`` admits waiting ones into free slots of the KV cache
(a prefill each; requests with the same prompt share one prefill), then runs up to ``sync_every``
decode steps for every running sequence together, then reads the new tokens back to the host once.
A decode step is one forward of one token per slot, on-device sampling and the slots' bookkeeping,
with fixed shapes — compiled, and on a GPU captured as a CUDA graph by ``torch.compile``'s
``reduce-overhead`` mode — so the host neither syncs nor launches per token. EOS and the token
budget are checked on the device; stop strings on the host at each read-back.

The engine knows nothing of HTTP or GRPO; it is not thread-safe (drive it from one thread).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch

from onegpu.errors import ConfigError
from onegpu.infer.decode_step import (
    DecodeState,
    Stepper,
    compile_mode,
    decode_once,
    first_tokens,
    freeze,
)
from onegpu.infer.prefill_thread import prefill_thread
from onegpu.infer.requests import Result, SamplingParams, Update
from onegpu.infer.slot_cache import SlotCache, kv_bytes_per_position, kv_dtype
from onegpu.infer.text import TextTracker

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "kv_bytes_per_position"]


@dataclass
class EngineConfig:
    max_slots: int = 8
    """Sequences decoded together (the KV cache holds this many)."""
    max_len: Optional[int] = None
    """KV positions per sequence: prompt + new tokens must fit. Default: the model's context."""
    compile: Literal["auto", "off", "on"] = "auto"
    """Compile the decode step (auto: on a GPU, as CUDA graphs; off on a CPU, where compiling
    costs a minute of start-up)."""
    compile_mode: Optional[str] = None
    """torch.compile mode (default: reduce-overhead on a GPU — CUDA graphs — default elsewhere)."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    sync_every: int = 8
    """Decode steps between read-backs to the host (stop strings, streaming, new requests)."""
    eos_ids: Optional[list[int]] = None
    """Tokens that end a sequence. Default: the model's generation config's, and the
    tokenizer's."""
    static_weights: bool = True
    """The weights do not change while the engine lives. A compiled step on a CPU then folds them
    into its graph (inductor's freezing: matmul weights prepacked once, where the RAM holds a
    second copy). False for a sampler of weights being trained (GRPO): it reads them live."""
    prefill_thread: Literal["auto", "on", "off"] = "auto"
    """Prefill on a second thread while this one decodes, on a CPU with a spare core (auto; see
    prefill_thread.py for where it is safe): a long prompt no longer stalls the running requests."""
    fixed_shape: bool = False
    """Every decode step runs all max_slots rows over all max_len positions: one compiled step
    (per sampling mode) whatever the requests' lengths and however many are still running, at the
    price of attending over the whole cache. For callers whose requests are alike and who compile
    (GRPO's rollouts): each other (rows, length) bucket would compile a step of its own."""


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_positions_used: int
    kv_positions_total: int


@dataclass
class _Seq:
    id: int
    prompt: list[int]
    params: SamplingParams
    adapter: Optional[str]
    tracker: TextTracker
    slot: int = -1
    generated: int = 0
    cancelled: bool = False
    prefilling: bool = False  # its slot is reserved, its prefill runs on the prefill thread
    logits: Optional[torch.Tensor] = None  # the prefill's last logits, during its admission


class Engine:
    def __init__(self, model, tokenizer, config: Optional[EngineConfig] = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        context = _context(model)
        self.max_len = min(self.config.max_len or context, context)
        self.max_slots = self.config.max_slots
        if self.max_slots < 1 or self.max_len < 2 or self.config.sync_every < 1:
            raise ConfigError(
                f"engine: max_slots {self.max_slots}, max_len {self.max_len}, sync_every "
                f"{self.config.sync_every}",
                hint="max_slots >= 1, max_len >= 2, sync_every >= 1",
            )
        self.device = model.get_input_embeddings().weight.device
        self.cache = SlotCache(self.max_slots, self.max_len, kv_dtype(model), self.device)
        self.state = DecodeState.empty(
            model,
            self.max_slots,
            self.config.eos_ids or _eos_ids(model, tokenizer),
            self.config.sync_every,
        )
        self.compiled = compile_mode(self.config, self.device)
        self.frozen = freeze(self.config, self.compiled, self.device, model)
        self.stepper = Stepper(self, self.compiled, self.config.compile_backend, self.frozen)
        self.prefills = prefill_thread(self.config.prefill_thread, self)
        # Once a request names an adapter, every forward names one per row ("__base__" for a
        # request without): PEFT would otherwise apply its active adapter to those.
        self.routing = False
        self._waiting: deque[_Seq] = deque()
        self._slots: list[Optional[_Seq]] = [None] * self.max_slots
        self._next_id = 0

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, adapter: Optional[str] = None
    ) -> int:
        """Queue a request; its id. Too long a request, a bad setting or an unknown adapter is a
        ConfigError naming it. ``adapter``: a PEFT adapter's name, or "__base__" for the base
        model; None runs the model as it is (its active adapter) until a request names one — from
        then on None means the base, so a server names "__base__" for its base requests."""
        params.check()
        if not prompt_ids:
            raise ConfigError("the prompt is empty.", hint="give at least one token")
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.max_len:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {need} is over the engine's limit of "
                f"{self.max_len} tokens.",
                hint="shorten the prompt or lower max_new_tokens to "
                f"{self.max_len - len(prompt_ids)}",
            )
        _check_adapter(self.model, adapter)
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer.", hint="give the engine one")
        self.routing = self.routing or adapter is not None
        seq = _Seq(
            self._next_id,
            list(prompt_ids),
            params,
            adapter,
            TextTracker(self.tokenizer, params.stop),
        )
        self._next_id += 1
        self._waiting.append(seq)
        return seq.id

    def cancel(self, request_id: int) -> None:
        for seq in [*self._waiting, *self._holders()]:
            if seq.id == request_id:
                seq.cancelled = True

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    def stats(self) -> EngineStats:
        running = self._holders()
        used = sum(len(s.prompt) + s.generated for s in running)
        return EngineStats(len(running), len(self._waiting), used, self.max_slots * self.max_len)

    # -- the loop ------------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self._slots.count(None)

    def step(self, interrupt: Optional[Callable[[], bool]] = None) -> list[Update]:
        """Admit, decode up to sync_every tokens, read back: the news of each request. The decode
        steps stop early where a request's budget ends (its answer goes out, its slot frees),
        where a prefill thread's prefill is done (its request joins), or where ``interrupt``,
        asked between decode steps, says True (a server: a new request waits for a free slot)."""
        updates = self._drop_cancelled()
        admitted = self._admit()
        if self.prefills is not None and self.prefills.pending():
            # nothing running (no one to keep waiting) or adapters now routed (PEFT's routing
            # hooks would reach a concurrent forward): every prefill is waited for
            wait = self.routing or not self._running()
            updates += self._drop(self.prefills.join(admitted, wait))
            self.prefills.help(admitted, len(self._running()))
        running = self._running()
        if not running:
            return updates
        steps = min(
            self.config.sync_every,
            min(s.params.max_new_tokens - s.generated - (s.id in admitted) for s in running),
        )
        in_use = max(s.slot for s in running) + 1
        if self.config.fixed_shape:
            rows, kv_len = self.max_slots, self.max_len
        elif self.stepper.compiled is None:
            # eager: a shape costs nothing to change, so the steps cover the slots in use and the
            # positions these steps reach (the last token read back, or the first, is written
            # at prompt + generated - 1), not a bucket of each request's final length
            rows = in_use
            reach = max(len(s.prompt) + max(s.generated - 1, 0) + steps for s in running)
            kv_len = min(-(-reach // 64) * 64, self.max_len)
        else:
            rows = _bucket(in_use, self.max_slots)
            longest = max(len(s.prompt) + s.params.max_new_tokens for s in running)
            kv_len = _bucket(longest, self.max_len, start=64)
        flags = (
            any(not s.params.greedy for s in running),
            any(s.params.repetition_penalty != 1.0 for s in running),
            any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in running),
        )
        adapters = self._adapter_names(rows)
        with torch.no_grad(), self.stepper.settings(adapters, rows):
            for j in range(steps):
                decode_once(self, rows, kv_len, flags, adapters, column=j)
                joins = self.prefills is not None and self.prefills.ready()
                if j + 1 < steps and (joins or (interrupt is not None and interrupt())):
                    steps = j + 1
                    break
        return updates + self._read_back(running, rows, steps)

    def generate(
        self,
        prompts: list[list[int]],
        params: Union[SamplingParams, list[SamplingParams]],
        adapters: Optional[list[Optional[str]]] = None,
    ) -> list[Result]:
        """Run requests to completion; results in the prompts' order."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        names = adapters or [None] * len(prompts)
        ids = [self.submit(p, s, a) for p, s, a in zip(prompts, each, names, strict=True)]
        done: dict[int, Result] = {}
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, str] = {i: "" for i in ids}
        while self.has_work():
            for u in self.step():
                tokens[u.request_id] += u.token_ids
                texts[u.request_id] += u.text
                if u.finished:
                    done[u.request_id] = Result(
                        tokens[u.request_id], texts[u.request_id], u.finish_reason, u.prompt_tokens
                    )
        return [done[i] for i in ids]

    # -- internals -----------------------------------------------------------------------------
    def _running(self) -> list[_Seq]:
        return [s for s in self._slots if s is not None and not s.prefilling]

    def _holders(self) -> list[_Seq]:
        """Every sequence in a slot: running, or being prefilled on the prefill thread."""
        return [s for s in self._slots if s is not None]

    def _drop_cancelled(self) -> list[Update]:
        """Cancelled requests, waiting or running (one being prefilled goes when its prefill is
        done: the thread writes into its slot until then)."""
        gone = [s for s in self._waiting if s.cancelled] + [
            s for s in self._running() if s.cancelled
        ]
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        return self._drop(gone)

    def _drop(self, gone: list[_Seq]) -> list[Update]:
        for s in gone:
            self._free(s)
        return [
            Update(
                s.id, [], s.tracker.take(final=True), True, "cancelled", len(s.prompt), s.generated
            )
            for s in gone
        ]

    def _admit(self) -> set:
        """Prefill waiting requests into free slots, lowest first (a decode step covers slots up to
        the highest in use). A prompt already prefilled in this round is copied, not recomputed."""
        admitted: list[_Seq] = []
        shared: dict[tuple, _Seq] = {}
        while self._waiting and None in self._slots:
            seq = self._waiting.popleft()
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq
            key = (tuple(seq.prompt), seq.adapter)
            if self.prefills is not None and not self.routing:
                seq.prefilling = True
                self.prefills.start(seq, shared.get(key))
                shared.setdefault(key, seq)
                continue
            if key in shared:
                self.cache.copy_slot(shared[key].slot, seq.slot, len(seq.prompt))
                first_tokens(self, seq, source=shared[key])
            else:
                first_tokens(self, seq, source=None)
                shared[key] = seq
            admitted.append(seq)
        for seq in admitted:
            seq.logits = None
        return {seq.id for seq in admitted}

    def _adapter_names(self, rows: int) -> Optional[list[str]]:
        """PEFT's per-row adapter names when a running request names an adapter (a mixed batch);
        then a request without one runs on the base model ("__base__")."""
        if not self.routing:
            return None
        names = ["__base__"] * rows
        for s in self._running():
            names[s.slot] = s.adapter or "__base__"
        return names

    def _read_back(self, running: list[_Seq], rows: int, steps: int) -> list[Update]:
        """One device-to-host copy for all the new tokens; finish what ended."""
        table = self.state.read_back(rows, steps)
        updates = []
        for seq in running:
            row = [t for t in table[seq.slot] if t >= 0]
            first = seq.generated == 0
            seq.generated += len(row)
            seq.tracker.add(row)
            ended = self._finish_reason(seq, row)
            if ended is not None:
                self._free(seq)
            updates.append(
                Update(
                    seq.id,
                    row,
                    seq.tracker.take(final=ended is not None),
                    ended is not None,
                    ended,
                    len(seq.prompt),
                    seq.generated,
                    first and bool(row),
                )
            )
        return updates

    def _finish_reason(self, seq: _Seq, row: list[int]) -> Optional[str]:
        if seq.tracker.stopped:
            return "stop"
        if row and row[-1] in self.state.eos_set and not seq.params.ignore_eos:
            return "stop"
        if seq.generated >= seq.params.max_new_tokens:
            return "length"
        return None

    def _free(self, seq: _Seq) -> None:
        if seq.slot >= 0 and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
            self.state.retire(seq.slot)


def _bucket(n: int, cap: int, start: int = 1) -> int:
    """The smallest power-of-two multiple of ``start`` that holds ``n``, at most ``cap``: a few
    fixed shapes, so a compiled step is reused instead of recompiled for every count."""
    size = start
    while size < n:
        size *= 2
    return min(size, cap)


def _context(model) -> int:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(
        f"{type(model).__name__}: its config names no context length.",
        hint="pass the engine's max_len",
    )


def _eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if (
        tokenizer is not None
        and tokenizer.eos_token_id is not None
        and tokenizer.eos_token_id not in ids
    ):
        ids.insert(0, tokenizer.eos_token_id)
    return ids


def _check_adapter(model, adapter: Optional[str]) -> None:
    if adapter is None or adapter == "__base__":
        return
    known = list(getattr(model, "peft_config", {}) or {})
    if adapter not in known:
        raise ConfigError(
            f"adapter '{adapter}' is not loaded.",
            hint=f"use one of: {', '.join(known) or '(none: the model has no adapters)'}",
        )
