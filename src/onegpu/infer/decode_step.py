"""The one-token decode step of every decode row at once, on the device: the runner's forward,
the sampler's choice and each row's bookkeeping (its next token and position, whether it still
decodes: ``Rows.advance``), reading nothing back — compiled once per (rows, kv_len, needs) bucket,
on a GPU replayed as a CUDA graph. Its state is the engine's rows (rows.py), tensors at fixed
addresses."""

from __future__ import annotations

import time
from typing import Optional

import torch

from onegpu.infer import cpu_attention, gqa_attention, policy, sampling
from onegpu.infer.batched_lora import BatchedLora
from onegpu.infer.decode_model import copyable, decode_model, moe
from onegpu.infer.paged_cache import base_model
from onegpu.infer.requests import BASE
from onegpu.infer.rows import Rows
from onegpu.infer.runner import ModelRunner
from onegpu.infer.sampling import Needs


class DecodeStep:
    """The decode step of the first ``rows`` rows over the first ``kv_len`` positions of their
    tables, as a function of (rows, kv_len, needs) only — everything else is tensors with fixed
    addresses — so torch.compile specialises it once per bucket.

    It runs on the engine's own copy of the model (decode_model.py: the same weights, its decode
    attention, MoE experts and batched LoRA set once), or on the user's model as it is where
    PEFT routes a run's adapters or nothing is to change."""

    def __init__(
        self,
        runner: ModelRunner,
        rows: Rows,
        mode: Optional[str],
        backend: str,
        rules: policy.Policy,
        buckets: int = 1,
        graph_pass=None,
    ):
        """``graph_pass``: an inductor post-grad pass for the compiled step (default: the policy's,
        small_gemv.py's on a GPU, its output head's on a CPU)."""
        self.runner, self.rows = runner, rows
        cuda = runner.device.type == "cuda"
        self.compiled, self.graph_pass = None, graph_pass
        if mode:
            self.compiled = self._compile(mode, backend, rules, buckets, graph_pass)
        self.warm: set[tuple] = set()  # the buckets (rows, kv_len, needs) compiled and run
        # the buckets compiled, and their first calls' seconds (compiling, and one step): during
        # a warm-up and after it (what a server's load pays for, 0 once every shape is warm)
        self.compiles = {"warmup": 0, "serving": 0}
        self.compile_s = {"warmup": 0.0, "serving": 0.0}
        self._phase = "serving"
        base = base_model(runner.model)
        loops = self.compiled is not None and backend == "inductor" and not cuda
        loops = loops and rules.cpu_attention_loops and gqa_attention.sdpa(base)
        grouped = gqa_attention.applies(base) and rules.gqa_decode
        grouped = gqa_attention.NAME if grouped else None
        self._attention = cpu_attention.NAME if loops else grouped
        self._experts = self.compiled is not None and rules.moe_batched_mm and moe(base)
        # a PeftModel's adapters by row as indices (batched_lora.py, a policy row)
        self.lora = BatchedLora.of(runner.model, rows.lora) if rules.batched_lora else None
        peft = getattr(runner.model, "peft_config", None)
        wanted = self.lora is not None if peft else bool(self._attention or self._experts)
        self.own = self._make_own() if wanted and copyable(base) else None
        if self.own is None:
            self.lora = None  # its stacks live in the copy
        # the attention the steps of a run on the engine's copy use
        self.attention = self._attention if self.own is not None else sdpa_name(base)
        self.on_own = self.own is not None  # this run's steps run on the copy

    def _compile(self, mode, backend: str, rules, buckets: int, graph_pass):
        """The step compiled under this engine's settings, given to torch.compile (no process-wide
        patch): the mode's options and the graph pass of the policy's rows — on a GPU
        small_gemv's, on a CPU the output head's (small_gemv.head)."""
        cuda = self.runner.device.type == "cuda"
        inductor = backend == "inductor"
        mode = mode if inductor else None  # others (tests: aot_eager) take none
        if graph_pass is None and inductor and rules.small_gemv:  # a CPU's only by policy_on
            from onegpu.infer.small_gemv import SmallGemv  # imports inductor: only here

            graph_pass = SmallGemv(self.runner.device.type)
        if graph_pass is None and inductor and rules.cpu_head_reduction and not cuda:
            from onegpu.infer import small_gemv

            graph_pass = small_gemv.head()
        self.graph_pass = graph_pass
        extra = {}
        if graph_pass is not None:
            extra["post_grad_custom_pre_pass"] = graph_pass
        options = None
        if extra:  # torch.compile takes a mode or options: the mode's own, and these
            options = {**torch._inductor.list_mode_options(mode), **extra} if mode else extra
            mode = None
        # each engine's compiled steps are its own (another engine's, over the same model or
        # at the same addresses, were compiled under that engine's settings), and as many as
        # its buckets, with batched LoRA and without (past Dynamo's default of 8 a bucket
        # would silently run eagerly)
        return torch.compile(
            self.step,
            backend=backend,
            mode=mode,
            options=options,
            dynamic=False,
            recompile_limit=2 * buckets,
            isolate_recompiles=True,
        )

    def _make_own(self):
        """The engine's copy of the base model, with the engine's choices set once."""
        if self._attention is not None:
            gqa_attention.register()
            cpu_attention.register(self._attention == cpu_attention.NAME)
        own = decode_model(base_model(self.runner.model), self._attention, self._experts)
        if self.lora is not None:
            self.lora.install(own)
        return own

    def route(self, names: Optional[list[str]]) -> Optional[list[str]]:
        """The adapters of the next decode run's rows (PEFT's names a row, or None: the model as
        it is): None where the run decodes on the engine's copy (batched LoRA takes the rows'
        adapters, written into ``rows.lora``), so its steps may be compiled; else ``names``, for
        PEFT on the user's model."""
        if self.own is None:
            self.on_own = False
            return names
        if self.lora is None:  # not a PeftModel: the copy decodes the model as it is
            self.on_own = names is None
            return names
        if self.lora.stale():  # adapters loaded since on layers the copy does not stack
            self.own = self._make_own()
        ids = self.lora.route(names)
        self.on_own = ids is not None
        if ids is not None:
            self.rows.set_adapters(ids)
        return None if self.on_own else names

    @property
    def by_index(self) -> bool:
        """This run's rows take their adapters from ``rows.lora`` (batched LoRA)."""
        return self.on_own and self.lora is not None

    def weights_changed(self) -> None:
        """The model's weights changed: batched LoRA's stacks copy its adapters again."""
        if self.lora is not None:
            self.lora.reload()

    def __call__(self, rows: int, kv_len: int, needs: Needs, adapters) -> tuple:
        if self.compiled is None or adapters is not None:  # PEFT routes adapters with hooks
            return self.step(rows, kv_len, needs, adapters)
        return self._compiled(rows, kv_len, needs)

    def _compiled(self, rows: int, kv_len: int, needs: Needs) -> tuple:
        if (rows, kv_len, needs) in self.warm:
            return self.compiled(rows, kv_len, needs, None)
        start = time.perf_counter()
        out = self.compiled(rows, kv_len, needs, None)
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
            with torch.no_grad():
                self.step(1, buckets[0][1], kinds[0], None)
        # CUDA graph trees run a new graph once and record it at its next call
        calls = 2 if self.runner.device.type == "cuda" else 1
        self._phase = "warmup"
        try:
            for needs in kinds:
                for rows, kv_len in buckets:
                    # the engine's steps run under no_grad, which Dynamo guards on
                    with torch.no_grad():
                        for _ in range(calls):
                            self(rows, kv_len, needs, None)
        finally:
            self._phase = "serving"
        return self.compiles["warmup"] - before

    def step(self, rows: int, kv_len: int, needs: Needs, adapters):
        """Each row's next token (-1 where it does not decode) and, where ``needs.logprobs``, the
        sampler's logprobs of the step (else None)."""
        st = self.rows
        model = self.own if self.on_own else self.runner.model
        pos, live = st.positions[:rows].clone(), st.live[:rows].clone()
        tables = st.tables[:rows, : kv_len // self.runner.block_size]
        deltas = st.rope_delta[:rows] if self.runner.mrope else None  # text models: none
        logits = self.runner.decode(st.tokens[:rows], pos, live, tables, adapters, model, deltas)
        params = st.params(slice(0, rows), st.generated[:rows], needs)
        nxt = sampling.sample(logits, params, needs)
        logprobs = sampling.logprobs(logits, nxt, needs, st.top)  # the model's own, before rules
        st.observe(torch.arange(rows, device=nxt.device), nxt, live, needs)
        st.advance(rows, nxt, live, pos)
        return torch.where(live, nxt, -1), logprobs


def compile_mode(compile_: str, mode: Optional[str], device) -> Optional[str]:
    """None (eager) or the torch.compile mode of the decode step (compile_: EngineConfig's)."""
    if compile_ == "off" or (compile_ == "auto" and device.type != "cuda"):
        return None
    mode = mode or ("reduce-overhead" if device.type == "cuda" else "default")
    # reduce-overhead means CUDA graphs: nothing to capture elsewhere
    return "default" if mode == "reduce-overhead" and device.type != "cuda" else mode


def sdpa_name(model) -> str:
    """The attention implementation the model's config names."""
    return getattr(model.config, "_attn_implementation", None) or "sdpa"
