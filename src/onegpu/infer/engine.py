"""The decode engine: what ``onegpu generate``, ``onegpu bench infer``, GRPO's rollouts and
``onegpu serve`` generate with.

Each ``step`` is one pass of a one-way flow:

    scheduler (which sequences run, under a token budget, in which KV blocks)
      -> runner (the model's forwards over the paged KV: prompt pieces, decode steps)
      -> sampler (the next tokens, on the device)
      -> output (one read-back; text decoded incrementally, stop strings, the callers' updates)

A step that computes prompt pieces runs one decode step for the running sequences beside them, and
a prompt's first token goes out with the step that finished its prompt; a step with no prompt to
compute runs up to ``sync_every`` decode steps on the device before the host looks (one while a
request with a grammar runs: the host advances its matcher and masks its next token, guided.py;
with ``flush_ms``, no more than fit in it at the steps' measured pace).
A decode step — one forward of one token per row, the sampling and each row's bookkeeping, with
fixed shapes — is compiled, and on a GPU captured as a CUDA graph. The engine knows nothing of HTTP
or GRPO; it is not thread-safe (drive it from one thread).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Optional, Union

import torch

from onegpu.errors import ConfigError
from onegpu.infer import constraints, policy
from onegpu.infer.decode_step import DecodeStep, Rows, compile_mode
from onegpu.infer.engine_config import (
    EngineConfig,
    Shapes,
    check_adapter,
    context_of,
    eos_ids_of,
    pool_blocks,
)
from onegpu.infer.guided import Guides
from onegpu.infer.kv_blocks import BlockPool
from onegpu.infer.output import Output, update
from onegpu.infer.paged_cache import PagedCache, kv_bytes_per_position, kv_dtype
from onegpu.infer.requests import EngineFeatures, EngineStats, Result, SamplingParams, Update
from onegpu.infer.runner import ModelRunner
from onegpu.infer.sampling import Needs, Sampler
from onegpu.infer.scheduler import Plan, Scheduler, SchedulerConfig, Sequence
from onegpu.infer.step_io import StepIO

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "kv_bytes_per_position"]

# what this engine applies beyond temperature, top-k/top-p, repetition penalty, seed and stop
# strings (docs/serve-engine-seams.md): a server refuses the fields of the others by name.
# Grammars need llguidance, an optional extra: without it an engine declares none
FEATURES = EngineFeatures(penalties=True, logprobs=True, constraints=True, bias=True)
# What a warm-up compiles by default: a plain request's steps, greedy and sampled (OpenAI's
# temperature 1); penalties, top-k/top-p, logprobs and grammars compile when first asked for
WARM_KINDS = (Needs(), Needs(sampling=True))


class Engine:
    def __init__(self, model, tokenizer, config: Optional[EngineConfig] = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        cfg.check()
        context = context_of(model)
        self.max_len = min(cfg.max_len or context, context)
        self.max_slots = cfg.max_slots
        if self.max_len < 2:
            raise ConfigError(f"engine: max_len {self.max_len}", hint="max_len >= 2")
        self.device = model.get_input_embeddings().weight.device
        self.vocab = model.get_input_embeddings().weight.shape[0]  # the ids a prompt may hold
        blocks, per_seq = pool_blocks(cfg, self.max_len)
        size = cfg.block_size
        self.pool = BlockPool(blocks, size, cfg.prefix_caching)
        self.cache = PagedCache(blocks, size, kv_dtype(model), self.device)
        self.runner = ModelRunner(model, self.cache, self.max_slots, per_seq * size)
        vocab = model.get_output_embeddings().weight.shape[0]
        eos = cfg.eos_ids or eos_ids_of(model, tokenizer)
        self.sampler = Sampler(self.max_slots, vocab, self.device, tuple(eos))
        self.eos_set = frozenset(eos)
        self.rows = Rows.empty(
            self.max_slots, per_seq, eos, cfg.sync_every, self.device, self.sampler.top
        )
        self.compiled = compile_mode(cfg.compile, cfg.compile_mode, self.device)
        self.policy = policy.Policy.for_device(self.device.type, cfg.policy_off)
        self.shapes = Shapes(
            self.max_slots, per_seq * size, size, cfg.fixed_shape, self.compiled is not None
        )
        self.decode_step = DecodeStep(
            self.runner,
            self.sampler,
            self.rows,
            self.compiled,
            cfg.compile_backend,
            self.policy,
            self.shapes.count(),
        )
        cpu_budget = policy.CPU_TOKEN_BUDGET if self.policy.cpu_token_budget else None
        budget = cfg.token_budget or cpu_budget or self.max_len
        self.scheduler = Scheduler(
            self.pool,
            SchedulerConfig(
                self.max_slots, budget, cfg.chunk or budget, cfg.sync_every, cfg.compact_rows
            ),
        )
        self.io = StepIO(self.rows, self.device)
        self.guides = Guides(tokenizer, vocab, self.sampler)
        grammars = constraints.available() and tokenizer is not None
        self.features = FEATURES if grammars else replace(FEATURES, constraints=False)
        # Once a request names an adapter, every forward names one per row ("__base__" for a
        # request without): PEFT would otherwise apply its active adapter to those.
        self.routing = False
        self._seqs: dict[int, Sequence] = {}
        self._outputs: dict[int, Output] = {}
        self._copied: dict[int, tuple] = {}  # row -> whose KV its eager-window copy holds
        self._next_id = 0
        self._step_s: deque = deque(maxlen=4)  # seconds per decode step, the last read-backs

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
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < self.vocab:
            raise ConfigError(
                f"the prompt holds token ids outside the model's vocabulary (0-{self.vocab - 1}):"
                f" {sorted({t for t in prompt_ids if not 0 <= t < self.vocab})[:5]}.",
                hint="encode the prompt with the model's own tokenizer",
            )
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.max_len:
            raise ConfigError(
                f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {need} is over the engine's limit of "
                f"{self.max_len} tokens.",
                hint="shorten the prompt or lower max_new_tokens to "
                f"{self.max_len - len(prompt_ids)}",
            )
        check_adapter(self.model, adapter)
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer.", hint="give the engine one")
        if params.constraint is not None and not self.features.constraints:
            raise ConfigError(
                "structured output needs a tokenizer and llguidance.",
                hint="give the engine a tokenizer; pip install 'onegpu[structured]'",
            )
        self.routing = self.routing or adapter is not None
        key = adapter or ("__base__" if self.routing else None)  # the weights its KV comes from
        seq = Sequence(self._next_id, list(prompt_ids), params, adapter, key)
        self._next_id += 1
        self._seqs[seq.id] = seq
        self._outputs[seq.id] = Output(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        return seq.id

    def cancel(self, request_id: int) -> None:
        if request_id in self._seqs:
            self._seqs[request_id].cancelled = True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def free_slots(self) -> int:
        return len(self.scheduler.free_rows)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (the weights changed, GRPO's next rollout)."""
        self.pool.reset_cache()
        self.decode_step.weights_changed()

    def warmup(self, kinds: tuple[Needs, ...] = WARM_KINDS) -> int:
        """Compile the decode step of every (rows, kv_len) bucket for each kind of request in
        ``kinds`` before the first request (with compiling off: nothing); the shapes compiled."""
        return self.decode_step.warm_up(self.shapes.buckets(), list(kinds))

    def stats(self) -> EngineStats:
        pool, s, step = self.pool, self.scheduler, self.decode_step
        used = (pool.usable - pool.free_count()) * pool.block_size
        return EngineStats(
            len(s.running),
            len(s.waiting),
            used,
            pool.usable * pool.block_size,
            pool.stats.queries,
            pool.stats.hits,
            s.preemptions,
            step.compiles["serving"],
            step.compile_s["serving"],
        )

    # -- the loop ------------------------------------------------------------------------------
    def step(self, interrupt: Optional[Callable[[], bool]] = None) -> list[Update]:
        """Schedule, run, sample, read back once: the news of each request. The decode steps stop
        early where ``interrupt``, asked between them, says True (a server: a request arrived and
        a row is free for it)."""
        updates = self._drop_cancelled()
        plan = self.scheduler.schedule(self._flush_steps())
        self.cache.reserve(self.pool.high_water)
        # a moved sequence's row state goes with it (an eager window finds its new row holding
        # another sequence than its copy did, and gathers the copy anew)
        for src, dst in plan.moved:
            self.io.move(src, dst)
            self.sampler.move(src, dst)
        for row in plan.freed:
            self.io.release(row)
        failed: dict[Sequence, BaseException] = {}  # requests this step ends with an error
        for seq in plan.started:
            try:
                self.sampler.start(seq.row, seq.params, seq.tokens, seq.generated)
                self.guides.start(seq)
            except Exception as exc:  # noqa: BLE001 - this request's own settings: it alone fails
                failed[seq] = exc
        # the rows this step samples: the decode rows and the prompts it finishes
        self.guides.fill([*plan.decode, *(p.seq for p in plan.pieces if p.last)], failed)
        self.io.upload([*plan.decode, *(p.seq for p in plan.pieces)])
        try:
            start = time.perf_counter()
            with torch.no_grad():
                rows, steps = self._decode(plan, interrupt) if plan.decode else (0, 0)
                firsts = self.io.prefill(
                    self.runner, self.sampler, plan.pieces, self._names, failed
                )
            table, first_tokens, logprobs = self.io.read_back(rows, steps, plan.decode, firsts)
            if self.config.flush_ms and steps and not plan.pieces:  # decode steps alone: their pace
                self._step_s.append((time.perf_counter() - start) / steps)
        except BaseException:
            # the blocks this step was to fill were registered when it was planned: a failed
            # step must not leave them to be found
            self.pool.reset_cache()
            raise
        news = self._process(plan, table, first_tokens, logprobs, failed)
        return updates + news + [self._fail(seq, exc, plan) for seq, exc in failed.items()]

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
    def _flush_steps(self) -> Optional[int]:
        """With flush_ms: the decode steps that fit in it at the recent steps' pace (the slowest
        of the last four read-backs: a step slows as rows join and the KV grows, and a bound kept
        at the median was overrun; one slow outlier costs four read-backs of fewer steps); None
        before any was timed or without flush_ms."""
        if self.config.flush_ms is None or not self._step_s:
            return None
        pace = max(self._step_s)
        return max(1, int(self.config.flush_ms / 1000 / max(pace, 1e-9)))

    def _decode(self, plan: Plan, interrupt) -> tuple[int, int]:
        """Up to ``plan.steps`` decode steps of the decode rows; the rows and steps run."""
        in_use = max(s.row for s in plan.decode) + 1
        reach = max(s.computed for s in plan.decode) + plan.steps
        rows, kv_len = self.shapes.of(in_use, reach)
        needs = Needs.of([s.params for s in plan.decode])
        adapters = None
        if self.routing:  # by row: a row that holds no sequence runs on the base model
            adapters = ["__base__"] * rows
            for s in self.scheduler.running:
                if s.row < rows:
                    adapters[s.row] = s.adapter or "__base__"
        adapters = self.decode_step.route(adapters)  # None: batched LoRA routes them by index
        steps = plan.steps
        window = self._window(plan, adapters, rows, kv_len)
        with window:
            for j in range(steps):
                self.rows.record(j, rows, *self.decode_step(rows, kv_len, needs, adapters))
                if j + 1 < steps and interrupt is not None and interrupt():
                    return rows, j + 1
        return rows, steps

    def _window(self, plan: Plan, adapters, rows: int, kv_len: int):
        """Eager decode steps read the rows' copy of their KV (decode_window.py, a policy row);
        compiled ones read the blocks where they lie. A row holding a sequence its copy does not
        (a new one, or one recomputed after preemption) has its copy gathered first."""
        eager = self.decode_step.compiled is None or adapters is not None
        if not (eager and self.policy.eager_window):
            return contextlib.nullcontext()
        # only the decoding rows: a row whose prompt is still being computed gets its copy when
        # it starts decoding, with the whole prompt in the pool
        holders = {s.row: (s.id, s.preemptions) for s in plan.decode}
        fresh = [r for r, who in holders.items() if self._copied.get(r) != who]
        self._copied.update(holders)
        tables = self.rows.tables[:rows, : kv_len // self.pool.block_size]
        return self.runner.decode_window(tables, self.rows.positions[:rows], fresh)

    def _names(self, seqs: list[Sequence]) -> Optional[list[str]]:
        """PEFT's per-row adapter names once a request names an adapter (a mixed batch); then a
        request without one runs on the base model ("__base__")."""
        return [s.adapter or "__base__" for s in seqs] if self.routing else None

    def _process(
        self, plan: Plan, table: dict, first_tokens: dict, logprobs: dict, failed: dict
    ) -> list[Update]:
        """Each sequence's new tokens (and their logprobs, for a request that asked): the cache's
        bookkeeping, its text, its end. A sequence whose own bookkeeping raises (its text, its
        stop strings) joins ``failed``."""
        updates = []
        for piece in plan.pieces:
            if not piece.last and piece.seq not in failed:
                self.scheduler.computed(piece.seq, piece.end)
        for seq, new in [*table.items(), *first_tokens.items()]:
            if seq in failed:  # its grammar's mask failed: the tokens its row made are dropped
                continue
            try:
                updates.append(self._news(seq, new, logprobs.get(seq)))
            except Exception as exc:  # noqa: BLE001 - this request's alone: the others go on
                failed[seq] = exc
        return updates

    def _news(self, seq: Sequence, new: list[int], logprobs) -> Update:
        first = seq.generated == 0
        complete = self.guides.accept(seq, new)  # a token its grammar refuses fails it here
        self.scheduler.extend(seq, new)
        output = self._outputs[seq.id]
        output.add(new)
        reason = self._finish_reason(seq, output, new, complete)
        if reason is not None:
            self._end(seq)
        news = update(
            seq.id, output, new, reason, len(seq.prompt), seq.generated, first and bool(new)
        )
        news.logprobs = logprobs
        if first and seq.params.prompt_logprobs is not None:
            news.prompt_logprobs = list(seq.prompt_logprobs or [None])
        return news

    def _fail(self, seq: Sequence, exc: BaseException, plan: Plan) -> Update:
        """``seq`` failed alone: its caller gets the error, its row and blocks go back, the
        blocks its prompt piece was to fill of this step are no longer found in the cache."""
        log.error("request %d failed: %s: %s", seq.id, type(exc).__name__, exc, exc_info=exc)
        for piece in plan.pieces:
            if piece.seq is seq:
                self.pool.forget(piece.writes(self.pool.block_size))
        if seq.id in self._seqs:  # not already ended (its end came before the failure)
            self._end(seq)
        error = f"{type(exc).__name__}: {exc}"
        return Update(seq.id, [], "", True, "error", len(seq.prompt), seq.generated, error=error)

    def _finish_reason(self, seq: Sequence, output: Output, new: list[int], complete: bool):
        """``complete``: the request's grammar is complete (only EOS may follow: it ends now,
        a step early, and ``ignore_eos`` cannot hold it in a mask of EOS alone)."""
        if output.stopped or complete:
            return "stop"
        if new and new[-1] in self.eos_set and not seq.params.ignore_eos:
            return "stop"
        if seq.generated >= seq.params.max_new_tokens:
            return "length"
        return None

    def _drop_cancelled(self) -> list[Update]:
        gone = [s for s in self._seqs.values() if s.cancelled]
        updates = []
        for seq in gone:
            out = self._outputs[seq.id]
            updates.append(
                update(seq.id, out, [], "cancelled", len(seq.prompt), seq.generated, False)
            )
            self._end(seq)
        return updates

    def _end(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self.io.release(seq.row)
        self.scheduler.finish(seq)
        self.guides.drop(seq)
        del self._seqs[seq.id]
        self._outputs.pop(seq.id)
