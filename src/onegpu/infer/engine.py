"""The decode engine: what ``onegpu generate``, ``onegpu bench infer``, GRPO's rollouts and
``onegpu serve`` generate with.

Each ``step`` is one pass of a one-way flow, and the engine is that loop and nothing else:

    scheduler (a frozen plan: which sequences run, under a token budget, in which KV blocks)
      -> rows (rows.py: the plan's moves, frees and starts on every per-row tensor at once)
      -> runner (forwards over the paged KV: decode steps, prefill.py's pieces, spec/verify.py's)
      -> sampler (sampling.py: logits -> tokens, pure; the grammars' masks passed in)
      -> output (one read-back; the one finish rule, text decoded incrementally, stop strings,
         the callers' updates)

A step with prompt pieces or proposals to verify (spec/) runs one decode step for the other rows;
otherwise up to ``sync_every`` decode steps (decode_step.py: compiled, a CUDA graph on a GPU) run
before the host looks (one while a grammar runs; with ``flush_ms``, as many as fit in it). The
engine knows nothing of HTTP or GRPO; it is not thread-safe (drive it from one thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Optional, Union

import torch

from onegpu.errors import ConfigError
from onegpu.infer import constraints, engine_stats, policy
from onegpu.infer.decode_step import DecodeStep, compile_mode
from onegpu.infer.engine_config import (
    EngineConfig,
    Shapes,
    check_adapter,
    check_request,
    eos_ids_of,
    max_len_of,
    pool_blocks,
)
from onegpu.infer.guided import Guides
from onegpu.infer.images import PromptImages, cache_key
from onegpu.infer.kv_blocks import BlockPool
from onegpu.infer.output import Output, logprobs_of, update
from onegpu.infer.paged_cache import PagedCache, kv_bytes_per_position, kv_dtype
from onegpu.infer.prefill import prefill
from onegpu.infer.requests import (
    BASE,
    EngineFeatures,
    EngineStats,
    Result,
    SamplingParams,
    Update,
)
from onegpu.infer.rows import Rows
from onegpu.infer.runner import ModelRunner
from onegpu.infer.sampling import Needs
from onegpu.infer.scheduler import Plan, Scheduler, SchedulerConfig, Sequence
from onegpu.infer.spec.speculator import Speculator

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "kv_bytes_per_position"]

# what this engine applies beyond temperature, top-k/top-p, repetition penalty, seed and stop
# strings (docs/serve-engine-seams.md; grammars need the llguidance extra)
FEATURES = EngineFeatures(penalties=True, logprobs=True, constraints=True, bias=True)
# What a warm-up compiles by default: a plain request's steps, greedy and sampled (OpenAI's
# temperature 1); penalties, top-k/top-p, logprobs and grammars compile when first asked for
WARM_KINDS = (Needs(), Needs(sampling=True))


class Engine:
    """``grammars``: the structured-output compiler to use (a server's, which checks requests as
    they arrive; default: made at the first constrained request). ``adapters``: the PEFT
    adapters the caller routes by name (a server's ``--adapter``s): each must be loaded, and every
    request without one runs on the base model (``BASE``) from the first; None: the model as it is
    until a request names one."""

    def __init__(
        self,
        model,
        tokenizer,
        config: Optional[EngineConfig] = None,
        grammars=None,
        adapters: Optional[tuple[str, ...]] = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        cfg.check()
        # the longest sequence, and with kv_budget how the memory sized the pool (KVPlan)
        self.max_len, self.pool_plan = max_len_of(cfg, model)
        self.max_slots = cfg.max_slots
        if self.max_len < 2:
            raise ConfigError(f"engine: max_len {self.max_len}", hint="max_len >= 2")
        for name in adapters or ():
            check_adapter(model, name)
        self.device = model.get_input_embeddings().weight.device
        self.vocab = model.get_input_embeddings().weight.shape[0]  # the ids a prompt may hold
        blocks, per_seq = pool_blocks(cfg, self.max_len, self.pool_plan)
        size = cfg.block_size
        self.pool = BlockPool(blocks, size, cfg.prefix_caching)
        self.cache = PagedCache(blocks, size, kv_dtype(model), self.device)
        self.runner = ModelRunner(model, self.cache, self.max_slots, per_seq * size)
        vocab = model.get_output_embeddings().weight.shape[0]
        eos = cfg.eos_ids or eos_ids_of(model, tokenizer)
        self.rows = Rows(self.max_slots, per_seq, vocab, eos, cfg.sync_every, self.device)
        self.compiled = compile_mode(cfg.compile, cfg.compile_mode, self.device)
        self.policy = policy.Policy.for_device(self.device.type, cfg.policy_off, cfg.policy_on)
        self.shapes = Shapes(
            self.max_slots, per_seq * size, size, cfg.fixed_shape, self.compiled is not None
        )
        self.decode_step = DecodeStep(
            self.runner,
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
        self.guides = Guides(tokenizer, vocab, self.max_slots, grammars)
        self.spec = Speculator.of(cfg, self.guides)  # speculative decoding's (on: spec.on)
        usable = constraints.available() and tokenizer is not None
        self.features = FEATURES if usable else replace(FEATURES, constraints=False)
        # Once a request names an adapter, every forward names one per row (BASE for a request
        # without): PEFT would otherwise apply its active adapter to those
        self.routing = bool(adapters)
        self._seqs: dict[int, Sequence] = {}
        self._outputs: dict[int, Output] = {}
        self._next_id = 0
        self._step_s: deque = deque(maxlen=4)  # seconds per decode step, the last read-backs
        self.totals = engine_stats.Totals()  # what the loop counts for EngineStats

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: Optional[str] = None,
        images: Optional[PromptImages] = None,
    ) -> int:
        """Queue a request; its id. Too long a request, a bad setting or an unknown adapter is a
        ConfigError naming it. ``adapter``: a PEFT adapter's name, or BASE for the base model;
        None runs the model as it is (its active adapter) until a request names one — from then
        on None means the base, so a server names BASE for its base requests. ``images``: the
        prompt's images as its processor made them (infer/images.py)."""
        images = check_request(self, prompt_ids, params, adapter, images)
        self.routing = self.routing or adapter is not None
        key = cache_key(adapter or (BASE if self.routing else None), images)  # what made its KV
        seq = Sequence(self._next_id, list(prompt_ids), params, adapter, key, images=images)
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

    def buckets(self) -> list[tuple[int, int]]:
        """The (rows, kv_len) shapes a decode step runs at (``EngineConfig.fixed_shape``: one)."""
        return self.shapes.buckets()

    def warm_shapes(self) -> int:
        """The (rows, kv_len) buckets ``warmup`` compiles for each kind (0: the step is eager)."""
        return len(self.buckets()) if self.compiled is not None else 0

    def warmup(self, kinds: tuple[Needs, ...] = WARM_KINDS) -> int:
        """Compile the decode step of every (rows, kv_len) bucket for each kind of request in
        ``kinds`` before the first request (with compiling off: nothing); the shapes compiled."""
        return self.decode_step.warm_up(self.shapes.buckets(), list(kinds))

    def stats(self) -> EngineStats:
        """Its load and totals now, and how it decodes (engine_stats.py; serve's /metrics)."""
        return engine_stats.snapshot(self)

    # -- the loop ------------------------------------------------------------------------------
    def step(self, arrived: Optional[threading.Event] = None) -> list[Update]:
        """Plan, apply the plan to the rows, run, sample, read back once: the news of each
        request. The decode steps stop early once ``arrived`` is set while a row is free (a
        server's: a request came in, and it can start now rather than after them)."""
        updates = self._drop_cancelled()
        plan = self.scheduler.schedule(self._flush_steps(), self.spec.on and self.spec.propose)
        self.cache.reserve(self.pool.high_water)
        # requests this step ends with an error (their own settings, grammar or prompt): each
        # fails alone
        failed = self.rows.apply(plan)
        failed.update(self.guides.start([s for s in plan.started if s not in failed]))
        sampled = [*plan.decode, *(p.seq for p in plan.pieces if p.last)]
        began = time.perf_counter()
        masks, refused = self.guides.masks([s for s in sampled if s not in failed])
        self.totals.grammar_s += time.perf_counter() - began
        failed.update(refused)
        self.rows.set_masks(masks)
        try:
            start = time.perf_counter()
            with torch.no_grad():
                rows, steps = self._decode(plan, arrived) if plan.decode else (0, 0)
                pre = prefill(self.runner, self.rows, list(plan.pieces), self._names, failed)
                spec = self.spec.verify(self.runner, self.rows, plan.spec, self._names)
            back = self.rows.read_back(rows, steps, plan.decode, pre.firsts, spec)
            if self.config.flush_ms and steps and not (plan.pieces or plan.spec):  # their pace
                self._step_s.append((time.perf_counter() - start) / steps)
        except BaseException:
            # the blocks this step was to fill were registered when it was planned: a failed
            # step must not leave them to be found
            self.pool.reset_cache()
            raise
        failed.update(pre.failed)
        news = self._output(plan, back, steps, pre, failed)
        self.spec.record(plan.spec, back.tokens, self.scheduler.trim)  # rejected KV goes back
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

    def _decode(self, plan: Plan, arrived: Optional[threading.Event]) -> tuple[int, int]:
        """Up to ``plan.steps`` decode steps of the decode rows; the rows and steps run."""
        in_use = max(s.row for s in plan.decode) + 1
        reach = max(s.computed for s in plan.decode) + plan.steps
        rows, kv_len = self.shapes.of(in_use, reach)
        needs = Needs.of([s.params for s in plan.decode])
        adapters = None
        if self.routing:  # by row: a row that holds no sequence runs on the base model
            adapters = [BASE] * rows
            for s in self.scheduler.running:
                if s.row < rows:
                    adapters[s.row] = s.adapter or BASE
        adapters = self.decode_step.route(adapters)  # None: batched LoRA routes them by index
        steps = 0
        with self._window(plan, adapters, rows, kv_len):
            while steps < plan.steps:
                self.rows.record(steps, rows, *self.decode_step(rows, kv_len, needs, adapters))
                steps += 1
                late = arrived is not None and arrived.is_set() and self.scheduler.free_rows
                if steps < plan.steps and late:
                    break
        # the furthest position these steps could write: a row's next, then one a step
        furthest = reach - plan.steps + steps - 1
        live, by_index = len(plan.decode), self.decode_step.by_index
        self.totals.decoded(rows, kv_len, steps, furthest, live, by_index)
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
        fresh = self.rows.fresh_windows(plan.decode)
        tables = self.rows.tables[:rows, : kv_len // self.pool.block_size]
        return self.runner.decode_window(tables, self.rows.positions[:rows], fresh)

    def _names(self, seqs: list[Sequence]) -> Optional[list[str]]:
        """PEFT's per-row adapter names once a request names an adapter (a mixed batch); then a
        request without one runs on the base model (BASE)."""
        return [s.adapter or BASE for s in seqs] if self.routing else None

    def _output(self, plan: Plan, back, steps: int, pre, failed: dict) -> list[Update]:
        """Each sequence's new tokens (and their logprobs, for a request that asked): the cache's
        bookkeeping, its text, its end. A sequence whose own bookkeeping raises (its text, its
        stop strings, its grammar) joins ``failed``."""
        for piece in plan.pieces:
            if not piece.last and piece.seq not in failed:
                self.scheduler.computed(piece.seq, piece.end)
        for seq, (first, entries) in pre.prompt_logprobs.items():
            if seq not in failed:
                self._outputs[seq.id].add_prompt_logprobs(first, entries)
        logprobs = logprobs_of(back, plan.decode, steps, self.rows.top)
        updates = []
        for seq, new in [*back.tokens.items(), *back.firsts.items()]:
            if seq in failed:  # its grammar's mask failed: the tokens its row made are dropped
                continue
            try:
                updates.append(self._news(seq, new, back.finish[seq], logprobs.get(seq)))
            except Exception as exc:  # noqa: BLE001 - this request's alone: the others go on
                failed[seq] = exc
        return updates

    def _news(self, seq: Sequence, new: list[int], code: int, logprobs) -> Update:
        first = seq.generated == 0
        began = time.perf_counter()
        try:
            complete = self.guides.accept(seq, new)  # a token its grammar refuses fails it here
        finally:
            self.totals.grammar_s += time.perf_counter() - began
        self.scheduler.extend(seq, new)
        output = self._outputs[seq.id]
        output.add(new)
        reason = output.reason(code, complete)
        if reason is not None:
            self._end(seq)
        asked = first and seq.params.prompt_logprobs is not None
        return update(
            seq.id,
            output,
            new,
            reason,
            len(seq.prompt),
            seq.generated,
            first and bool(new),
            logprobs,
            list(output.prompt_logprobs) if asked else None,
        )

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
            self.rows.free(seq.row)
        self.scheduler.finish(seq)
        self.guides.drop(seq)
        self.spec.drop(seq)
        del self._seqs[seq.id]
        self._outputs.pop(seq.id)
