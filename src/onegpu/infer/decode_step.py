"""The one-token decode step of every decode row at once, on the device: the runner's forward,
the sampler's choice and each row's bookkeeping (its next token and position, whether it still
decodes), reading nothing back — compiled once per (rows, kv_len, needs) bucket, on a GPU replayed
as a CUDA graph. ``Rows`` is each row's state as tensors at fixed addresses."""

from __future__ import annotations

import itertools
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Optional

import torch

from onegpu.infer import cpu_attention, gqa_attention, policy
from onegpu.infer.batched_lora import BASE, BatchedLora
from onegpu.infer.paged_cache import base_model
from onegpu.infer.runner import ModelRunner
from onegpu.infer.sampling import Needs, Sampler


@dataclass
class Rows:
    """Per decode row: the token to feed next and its position, whether the row decodes, its
    request's token budget and the tokens it has generated, its block table ``tables [rows,
    blocks]``, its LoRA adapter ``lora`` (an index in batched_lora's stacks, 0 the base model);
    ``out`` collects the tokens of the steps since the last read-back, and beside it
    ``chosen [rows, steps]``, ``top_ids``/``top_logprobs [rows, steps, top]`` their logprobs and
    each step's likeliest tokens (written by the steps that compute them: a row asking for
    logprobs ran in them)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    live: torch.Tensor
    budget: torch.Tensor
    generated: torch.Tensor
    ignore_eos: torch.Tensor
    tables: torch.Tensor
    out: torch.Tensor
    eos: torch.Tensor
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    lora: torch.Tensor
    host_tables: Optional[torch.Tensor] = None  # the tables as the host writes them

    @classmethod
    def empty(
        cls, rows: int, blocks: int, eos_ids: list[int], sync_every: int, device, top: int = 0
    ) -> Rows:
        def z(dtype, *shape, fill=0):
            return torch.full(shape or (rows,), fill, dtype=dtype, device=device)

        state = cls(
            tokens=z(torch.long),
            positions=z(torch.long),
            live=z(torch.bool),
            budget=z(torch.long),
            generated=z(torch.long),
            ignore_eos=z(torch.bool),
            tables=z(torch.long, rows, blocks),
            out=z(torch.long, rows, sync_every, fill=-1),
            eos=torch.tensor(eos_ids or [-2], dtype=torch.long).to(device),
            chosen=z(torch.float, rows, sync_every),
            top_ids=z(torch.long, rows, sync_every, top),
            top_logprobs=z(torch.float, rows, sync_every, top),
            lora=z(torch.long),
        )
        cuda = torch.device(device).type == "cuda"
        if cuda:  # CUDA graphs replay on fixed addresses
            for f in fields(cls):
                if getattr(state, f.name) is not None:
                    torch._dynamo.mark_static_address(getattr(state, f.name))
        # on a CPU the host's tables are the device's
        state.host_tables = torch.zeros_like(state.tables, device="cpu") if cuda else state.tables
        return state

    def start(self, row: int, token: torch.Tensor, position: int, generated: int, params) -> None:
        """Row ``row`` decodes from ``token`` (on the device: the first token of its answer, or
        the next one after a recompute) at ``position``."""
        self.tokens[row : row + 1] = token
        self.positions[row], self.generated[row] = position, generated
        self.budget[row], self.ignore_eos[row] = params.max_new_tokens, params.ignore_eos
        ended = (torch.isin(token, self.eos) & ~self.ignore_eos[row]) | (
            self.generated[row] >= self.budget[row]
        )
        self.live[row : row + 1] = ~ended

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence decodes in row ``dst`` from now on (the scheduler compacts the
        rows); ``src`` holds nothing. Its table goes with it when the caller sets ``dst``'s."""
        per_row = (self.tokens, self.positions, self.live, self.budget, self.generated)
        for t in (*per_row, self.ignore_eos, self.lora):
            t[dst] = t[src]
        self.retire(src)

    def retire(self, row: int) -> None:
        self.live[row], self.positions[row], self.lora[row] = False, 0, 0
        self.set_table(row, [])  # the null block: the row's writes land where nobody reads

    def set_table(self, row: int, blocks: list[int]) -> None:
        """Row ``row``'s block table, written on the host (``upload`` takes it to the device)."""
        host = self.host_tables
        host[row, : len(blocks)] = torch.tensor(blocks, dtype=host.dtype)
        host[row, len(blocks) :] = 0

    def upload(self) -> None:
        if self.host_tables is not self.tables:  # on a CPU they are one tensor
            self.tables.copy_(self.host_tables, non_blocking=True)

    def record(self, column: int, rows: int, tokens: torch.Tensor, logprobs=None) -> None:
        """A decode step's tokens (and their logprobs, when the step computed them: the
        sampler's ``(chosen, top ids, top logprobs)``), kept on the device until the step's
        read-back."""
        self.out[:rows, column] = tokens
        if logprobs is not None:
            chosen, ids, values = logprobs
            self.chosen[:rows, column] = chosen
            self.top_ids[:rows, column] = ids
            self.top_logprobs[:rows, column] = values

    def read_back(self, rows: int, steps: int) -> list[list[int]]:
        return self.out[:rows, :steps].tolist()


_KEYS = itertools.count(1)
# Dynamo keeps the compiled buckets of every engine on the one code object of DecodeStep.step;
# each compiled step adds how many buckets it can compile, and its calls run with Dynamo's limits
# at least at the total (past its default of 8 a bucket would silently run eagerly)
_ENTRIES = [0]


class DecodeStep:
    """The decode step of the first ``rows`` rows over the first ``kv_len`` positions of their
    tables, as a function of (rows, kv_len, needs) only — everything else is tensors with fixed
    addresses — so torch.compile specialises it once per bucket."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        rows: Rows,
        mode: Optional[str],
        backend: str,
        rules: policy.Policy,
        buckets: int = 1,
    ):
        self.runner, self.sampler, self.rows = runner, sampler, rows
        self.compiled = None
        if mode:
            mode = mode if backend == "inductor" else None  # others (tests: aot_eager) take none
            self.compiled = torch.compile(self.step, backend=backend, mode=mode, dynamic=False)
            _ENTRIES[0] += buckets
        # Dynamo would hand this step another engine's compiled entry — one over the same model
        # (weights folded in as they were then), or one whose objects sat at the addresses this
        # engine's now hold (its guards match ids) — compiled under that engine's settings; a
        # number of its own, passed in, gives each engine steps of its own
        self.key = next(_KEYS)
        self.inductor = {}
        self.warm: set[tuple] = set()  # the buckets (rows, kv_len, needs) compiled and run
        # the buckets compiled, and their first calls' seconds (compiling, and one step): during
        # a warm-up and after it (what a server's load pays for, 0 once every shape is warm)
        self.compiles = {"warmup": 0, "serving": 0}
        self.compile_s = {"warmup": 0.0, "serving": 0.0}
        self._phase = "serving"
        cuda = runner.device.type == "cuda"
        if self.compiled is not None and backend == "inductor" and cuda and rules.small_gemv:
            from onegpu.infer.small_gemv import SmallGemv  # imports inductor: only here

            self.inductor["post_grad_custom_pre_pass"] = SmallGemv()
        self.experts = _moe_model(runner.model) if self.compiled is not None else None
        # a PeftModel's adapters by row as indices (batched_lora.py, a policy row)
        self.lora = BatchedLora.of(runner.model, rows.lora) if rules.batched_lora else None
        self.by_index = False  # this run's rows take their adapters from rows.lora
        if self.compiled is not None and self.lora is not None:
            _ENTRIES[0] += buckets  # each bucket's step with batched LoRA on, and with it off
        base = base_model(runner.model)
        loops = self.compiled is not None and backend == "inductor" and not cuda
        loops = loops and rules.cpu_attention_loops and gqa_attention.sdpa(base)
        self.attention = cpu_attention.NAME if loops else gqa_attention.NAME
        self.grouped = base if loops or gqa_attention.applies(base) else None
        if self.grouped is not None:
            gqa_attention.register()
            cpu_attention.register(loops)

    def route(self, names: Optional[list[str]]) -> Optional[list[str]]:
        """The adapters of the next decode run's rows (PEFT's names a row, or None: the model as
        it is): None where batched LoRA takes them (written into ``rows.lora``), so the run
        passes PEFT no names and its steps may be compiled; else ``names``, for PEFT."""
        self.by_index = names is not None and self.lora is not None and self.lora.route(names)
        return None if self.by_index else names

    def weights_changed(self) -> None:
        """The model's weights changed: batched LoRA's stacks copy its adapters again."""
        if self.lora is not None:
            self.lora.reload()

    def settings(self, adapters, rows: int = 0) -> ExitStack:
        """What the steps of ``rows`` rows run under: the engine's decode attention (a GQA
        model's without repeat_kv's copy; a compiled CPU step's as inductor loops), the batched
        LoRA of a run whose rows ``route`` took; for a compiled call also inductor's settings
        (read from the global config when a bucket compiles) and MoE experts as ``batched_mm``."""
        stack = ExitStack()
        if self.by_index and adapters is None:
            stack.enter_context(self.lora.applied())
        loops = self.attention == cpu_attention.NAME
        if self.grouped is not None:
            name = self.attention if loops else gqa_attention.NAME
            stack.enter_context(gqa_attention.grouped_decode(self.grouped, name))
        if self.compiled is None or adapters is not None:
            return stack
        if self.inductor:
            stack.enter_context(torch._inductor.config.patch(self.inductor))
        if self.experts is not None:
            stack.enter_context(batched_mm_experts(self.experts))
        return stack

    def __call__(self, rows: int, kv_len: int, needs: Needs, adapters) -> tuple:
        if self.compiled is None or adapters is not None:  # PEFT routes adapters with hooks
            return self.step(rows, kv_len, needs, adapters)
        config = torch._dynamo.config
        limits = dict(
            recompile_limit=max(config.recompile_limit, _ENTRIES[0]),
            accumulated_recompile_limit=max(config.accumulated_recompile_limit, _ENTRIES[0]),
        )
        with config.patch(limits):
            return self._compiled(rows, kv_len, needs)

    def _compiled(self, rows: int, kv_len: int, needs: Needs) -> tuple:
        if (rows, kv_len, needs) in self.warm:
            return self.compiled(rows, kv_len, needs, None, self.key)
        start = time.perf_counter()
        out = self.compiled(rows, kv_len, needs, None, self.key)
        self.compiles[self._phase] += 1
        self.compile_s[self._phase] += time.perf_counter() - start
        self.warm.add((rows, kv_len, needs))
        return out

    def warm_up(self, buckets: list[tuple[int, int]], kinds: list[Needs]) -> int:
        """Compile (on a GPU also capture) the step of each (rows, kv_len) bucket for each kind of
        ``kinds`` by running it once while no row decodes: every row writes into the null block
        and keeps its state. The buckets compiled."""
        if self.compiled is None:
            return 0
        if bool(self.rows.live.any()):
            raise RuntimeError("a decode step warms up before any row decodes")
        before = self.compiles["warmup"]
        # a model with adapters decodes with batched LoRA once a request names one (a server's
        # every request): its steps are the ones to warm
        self.route([BASE] * self.rows.lora.shape[0] if self.lora is not None else None)
        if not self.runner.cache.keys:  # the pool's layers are made by a first forward: eager,
            # so that no compiled step guards on their absence
            with torch.no_grad(), self.settings(None, 1):
                self.step(1, buckets[0][1], kinds[0], None)
        # CUDA graph trees run a new graph once and record it at its next call
        calls = 2 if self.runner.device.type == "cuda" else 1
        self._phase = "warmup"
        try:
            for needs in kinds:
                for rows, kv_len in buckets:
                    # the engine's steps run under no_grad, which Dynamo guards on
                    with torch.no_grad(), self.settings(None, rows):
                        for _ in range(calls):
                            self(rows, kv_len, needs, None)
        finally:
            self._phase = "serving"
        return self.compiles["warmup"] - before

    def step(self, rows: int, kv_len: int, needs: Needs, adapters, key: int = 0):
        """Each row's next token (-1 where it does not decode) and, where ``needs.logprobs``, the
        sampler's logprobs of the step (else None)."""
        st = self.rows
        if key < 0:  # never: the test makes Dynamo guard on the key (unread, it would not)
            raise ValueError(key)
        pos, live = st.positions[:rows].clone(), st.live[:rows].clone()
        tables = st.tables[:rows, : kv_len // self.runner.block_size]
        logits = self.runner.decode(st.tokens[:rows], pos, live, tables, adapters)
        generated = st.generated[:rows]
        nxt = self.sampler.sample(logits, slice(0, rows), generated, needs)
        logprobs = self.sampler.logprobs(logits, nxt, needs)  # the model's own: before any rule
        count = generated + 1
        ended = (torch.isin(nxt, st.eos) & ~st.ignore_eos[:rows]) | (count >= st.budget[:rows])
        st.tokens[:rows] = torch.where(live, nxt, st.tokens[:rows])
        st.positions[:rows] = pos + live.long()
        st.generated[:rows] = torch.where(live, count, generated)
        self.sampler.observe(torch.arange(rows, device=nxt.device), nxt, live, needs)
        st.live[:rows] = live & ~ended
        return torch.where(live, nxt, -1), logprobs


def compile_mode(compile_: str, mode: Optional[str], device) -> Optional[str]:
    """None (eager) or the torch.compile mode of the decode step (compile_: EngineConfig's)."""
    if compile_ == "off" or (compile_ == "auto" and device.type != "cuda"):
        return None
    mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
    # reduce-overhead means CUDA graphs: nothing to capture elsewhere
    return "default" if mode == "reduce-overhead" and device.type != "cuda" else mode


@contextmanager
def batched_mm_experts(model):
    """A compiled step's MoE experts as ``batched_mm`` (each token's experts gathered, one bmm): no
    host sync and fixed shapes, which a CUDA graph needs. transformers' other kernels read the
    routing on the host (its grouped_mm fallback for non-bf16 weights calls ``tolist()``; the
    per-expert loop asks which experts were hit), which a graph capture refuses. Only the decode
    steps switch — a prefill or a training step of the same model would gather each of its many
    tokens' expert weights — and the model's own choice, read at each switch, is back on exit."""
    current = model.config._experts_implementation
    if current in (None, "batched_mm"):
        yield
        return
    model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def _moe_model(model):
    """The (base) model if it has experts that transformers dispatches by implementation."""
    base = base_model(model)
    if getattr(base.config, "_experts_implementation", None) is None:
        return None
    has = any(getattr(m, "has_gate", None) is not None for m in base.modules())
    return base if has else None
