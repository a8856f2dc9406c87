"""The engine's device side: each slot's state as tensors, the prefill that starts a request,
and the one-token decode step (compiled) that advances every slot at once, reading nothing back."""

from __future__ import annotations

import itertools
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Optional

import torch

from onegpu.infer import cpu_attention, gqa_attention
from onegpu.infer.sampling import RowParams, next_tokens
from onegpu.infer.slot_cache import base_model, cache_kwarg, masks


@dataclass
class DecodeState:
    """Per slot: the token to feed next, where it goes, whether the slot still decodes, its budget
    and sampling settings; ``out`` collects the tokens of the steps since the last read-back."""

    tokens: torch.Tensor
    positions: torch.Tensor
    live: torch.Tensor
    budget: torch.Tensor
    ignore_eos: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    penalty: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    seen: torch.Tensor
    first: torch.Tensor  # a newly admitted slot's first token until it is read back, else -1
    out: torch.Tensor
    eos: torch.Tensor
    eos_set: frozenset

    @classmethod
    def empty(cls, model, slots: int, eos_ids: list[int], sync_every: int = 64) -> DecodeState:
        device = model.get_input_embeddings().weight.device
        vocab = model.get_output_embeddings().weight.shape[0]

        def z(dtype, *shape, fill=0):
            return torch.full(shape or (slots,), fill, dtype=dtype, device=device)

        state = cls(
            tokens=z(torch.long),
            positions=z(torch.long),
            live=z(torch.bool),
            budget=z(torch.long),
            ignore_eos=z(torch.bool),
            temperature=z(torch.float),
            top_k=z(torch.long),
            top_p=z(torch.float, fill=1.0),
            penalty=z(torch.float, fill=1.0),
            seed=z(torch.long),
            step=z(torch.long),
            seen=z(torch.bool, slots, vocab),
            first=z(torch.long, fill=-1),
            out=z(torch.long, slots, sync_every, fill=-1),
            eos=torch.tensor(eos_ids or [-2], dtype=torch.long).to(device),
            eos_set=frozenset(eos_ids),
        )
        if device.type == "cuda":  # CUDA graphs replay on fixed addresses
            for f in fields(cls):
                value = getattr(state, f.name)
                if isinstance(value, torch.Tensor):
                    torch._dynamo.mark_static_address(value)
        return state

    def params(self, rows: slice) -> RowParams:
        return RowParams(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.penalty[rows],
            self.seed[rows],
            self.step[rows],
            self.seen[rows],
        )

    def read_back(self, rows: int, steps: int) -> list[list[int]]:
        table = torch.cat([self.first[:rows, None], self.out[:rows, :steps]], 1).tolist()
        self.first[:rows] = -1
        return table

    def retire(self, slot: int) -> None:
        self.live[slot] = False
        self.first[slot] = -1


def first_tokens(engine, seq, source, logits: Optional[torch.Tensor] = None) -> None:
    """Start ``seq`` in its slot: prefill its prompt (or take the logits of ``source``, whose prompt
    is the same and whose KV was copied in, or ``logits``, a prefill thread's), sample its first
    token, set the slot's state."""
    st, row = engine.state, seq.slot
    p, n = seq.params, len(seq.prompt)
    st.temperature[row], st.top_k[row], st.top_p[row] = p.temperature, p.top_k, p.top_p
    st.penalty[row], st.seed[row], st.step[row] = p.repetition_penalty, p.seed, 0
    st.budget[row], st.ignore_eos[row] = p.max_new_tokens, p.ignore_eos
    st.seen[row] = False
    st.seen[row, torch.tensor(seq.prompt).to(st.seen.device)] = True
    if logits is not None:
        seq.logits = logits
    elif source is None:
        with torch.no_grad():
            seq.logits = prefill(engine, seq)
    else:
        seq.logits = source.logits
    sl = slice(row, row + 1)
    with torch.no_grad():
        tok = next_tokens(
            seq.logits,
            st.params(sl),
            not p.greedy,
            p.repetition_penalty != 1.0,
            p.top_k > 0 or p.top_p < 1.0,
        )
    st.tokens[sl], st.positions[row], st.step[row] = tok, n, 1
    st.first[sl] = tok
    st.seen[row, tok] = True
    eos = torch.isin(tok, st.eos) & ~st.ignore_eos[sl]
    st.live[sl] = ~(eos | (st.budget[sl] <= 1))


def prefill(engine, seq, cache=None, routed: Optional[bool] = None) -> torch.Tensor:
    """The prompt's forward into its slot of ``cache`` (the engine's; a prefill thread passes its
    own over the same tensors); its last logits. ``routed``: name the request's adapter (default:
    whether the engine routes adapters)."""
    n = len(seq.prompt)
    cache = engine.cache if cache is None else cache
    routed = engine.routing if routed is None else routed
    ids = torch.tensor([seq.prompt]).to(engine.device)  # built on the host, then moved
    cache.prefill(seq.slot, n)
    kw = _adapter_kwargs(engine, [seq.adapter] if routed else None)
    out = engine.model(
        input_ids=ids,
        position_ids=torch.arange(n, device=engine.device)[None],
        attention_mask=_masks(engine, torch.full((1,), n - 1, device=engine.device), n, n),
        **{cache_kwarg(engine.model): cache},
        use_cache=True,
        logits_to_keep=1,
        **kw,
    )
    return out.logits[:, -1].float()


def _masks(engine, positions, kv_len: int, query_len: int = 1):
    config = engine.model.config
    return masks(
        config, positions, kv_len, engine.cache.dtype, config._attn_implementation, query_len
    )


def _adapter_kwargs(engine, names: Optional[list]) -> dict:
    """Extra forward arguments: PEFT's per-row adapters; and no MoE router loss (a model trained
    with it keeps output_router_logits in its config, and that loss would read the attention mask
    as a 2D padding mask)."""
    kw = {} if names is None else {"adapter_names": [n or "__base__" for n in names]}
    if getattr(engine.model.config, "output_router_logits", False):
        kw["output_router_logits"] = False
    return kw


# the engine's compile policy (``config``: its EngineConfig)
def compile_mode(config, device) -> Optional[str]:
    """None (eager) or the torch.compile mode of the decode step."""
    if config.compile == "off" or (config.compile == "auto" and device.type != "cuda"):
        return None
    mode = config.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
    # reduce-overhead means CUDA graphs: nothing to capture elsewhere
    return "default" if mode == "reduce-overhead" and device.type != "cuda" else mode


def freeze(config, mode: Optional[str], device, model) -> bool:
    """Fold the weights into the compiled CPU step: 3.47 against 4.33 ms per step at batch 1 on the
    tiny preset, the same at batch 16 (benchmarks/results/engine-freezing-cpu.md). Inductor then
    keeps its own prepacked copy of each matmul weight, so only where the RAM has room for a second
    copy; never on a GPU (its memory is the scarce one) or for weights that change."""
    if not config.static_weights or mode is None or device.type != "cpu":
        return False
    if config.compile_backend != "inductor":  # freezing is inductor's
        return False
    from onegpu.hardware import host_memory_available

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * weights < host_memory_available()


# ``engine`` below is the Engine that owns this state (engine.py; not imported: it imports this)


_FROZEN = itertools.count(1)

# A frozen CPU step: the weights are constants of the graph (freezing), so inductor can also
# generate each matmul as its own C++ GEMM over a weight it prepacks once, where that beats the
# library's call; each matmul shape is timed once against MKL's (max_autotune_gemm, the winner
# kept; ATen stays a choice so a matmul the template cannot take keeps MKL). The tiny preset's
# output head at 16 rows: 2.2 against 5.4 ms a call. And the step's kernels are called from
# generated C++ (cpp_wrapper), not Python: 0.3 ms less a step at batch 1. Both timed in
# benchmarks/results/engine-gemm-template-cpu.md.
FROZEN_CPU_STEP = dict(
    freezing=True,
    max_autotune_gemm=True,
    max_autotune_gemm_backends="CPP,ATEN",
    cpp_wrapper=True,
)


class Stepper:
    """The one-token step of all slots, as a function of (rows, kv_len, sampling, penalty) only —
    everything else is tensors with fixed addresses — so torch.compile specialises it once per
    bucket and, on a GPU, replays it as a CUDA graph."""

    def __init__(self, engine, mode: Optional[str], backend: str = "inductor", freeze=False):
        self.engine = engine
        self.kwarg = cache_kwarg(engine.model)
        self.compiled = None
        if mode:
            # one compiled entry per (rows, kv_len, flags) bucket: past dynamo's default limit of
            # 8 the later buckets would silently run eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            mode = mode if backend == "inductor" else None  # others (tests: aot_eager) take none
            self.compiled = torch.compile(self.step, backend=backend, mode=mode, dynamic=False)
        # Dynamo would hand another engine over the same model this one's compiled step, weights
        # folded in as they were then; a number of its own, passed in, gives it a step of its own
        self.key = next(_FROZEN) if freeze else 0
        # inductor's settings while a bucket compiles (freeze: decided by freeze() above, only
        # for a compiled step; profile_engine.py --gemm-ab times other settings); on a GPU the
        # small matmuls as reductions (small_gemv; profile_engine_gpu.py times it)
        self.inductor = dict(FROZEN_CPU_STEP) if freeze else {}
        if self.compiled is not None and backend == "inductor" and engine.device.type == "cuda":
            from onegpu.infer.small_gemv import SmallGemv  # imports inductor: only here

            self.inductor["post_grad_custom_pre_pass"] = SmallGemv()
        self.warm: set[tuple] = set()  # (rows, kv_len, flags) buckets compiled and run once
        self.skip_guards = True  # on a warm bucket (profile_engine.py --guards-ab times False)
        # the MoE model whose experts a compiled step switches (found once; None: nothing to do)
        self.experts = _moe_model(engine.model) if self.compiled is not None else None
        # the model whose decode steps attend with the engine's own function (None: transformers'
        # as configured): an SDPA model's compiled CPU steps as inductor's loops (cpu_attention),
        # a GQA model's other steps without repeat_kv (gqa_attention)
        base = base_model(engine.model)
        cpu_loops = self.compiled is not None and backend == "inductor"
        cpu_loops = cpu_loops and engine.device.type == "cpu" and gqa_attention.sdpa(base)
        self.attention = cpu_attention.NAME if cpu_loops else gqa_attention.NAME
        # fewer rows keep SDPA's kernel: at one row it is as fast (engine-cpu-attention.md)
        self.loops_from = cpu_attention.MIN_ROWS
        # with the loops, the query (RoPE's sin and cos in it) becomes a buffer before the scores
        # read it; at inductor's CPU default (50 ops) it is recomputed inside the loop over every
        # cached position: 2.1 against 0.77 ms a layer at 16 rows (engine-cpu-attention.md)
        self.realize_ops: Optional[int] = cpu_attention.REALIZE_OPS
        self.grouped = base if cpu_loops or gqa_attention.applies(base) else None
        if self.grouped is not None:
            gqa_attention.register()
            cpu_attention.register()

    def settings(self, adapters, rows: int = 0) -> ExitStack:
        """What the steps of ``rows`` rows run under. Every step, eager or compiled: the engine's
        decode attention (a GQA model's without repeat_kv's copy; a compiled CPU step's of
        ``loops_from`` rows or more as inductor loops). The compiled calls also: inductor's
        freezing and GEMM templates (FROZEN_CPU_STEP, Engine's static_weights) and the loops'
        realize threshold, which inductor reads from the global config when a bucket compiles,
        not from torch.compile's options; and MoE experts as ``batched_mm``
        (batched_mm_experts)."""
        stack = ExitStack()
        loops = self.attention == cpu_attention.NAME and rows >= self.loops_from
        if self.grouped is not None:
            name = self.attention if loops else gqa_attention.NAME
            stack.enter_context(gqa_attention.grouped_decode(self.grouped, name))
        if self.compiled is None or adapters is not None:
            return stack
        inductor = dict(self.inductor)
        if loops and self.realize_ops is not None:
            inductor["realize_opcount_threshold"] = self.realize_ops
        if inductor:
            stack.enter_context(torch._inductor.config.patch(inductor))
        if self.experts is not None:
            stack.enter_context(batched_mm_experts(self.experts))
        return stack

    def __call__(self, rows, kv_len, flags: tuple, adapters) -> torch.Tensor:
        if self.compiled is None or adapters is not None:  # PEFT routes adapters with hooks
            return self.step(rows, kv_len, flags, adapters)
        bucket = (rows, kv_len, flags)
        if self.skip_guards and bucket in self.warm:
            # a bucket this stepper compiled: Dynamo checks only the guards that tell its
            # compiled entries apart, not the ~1,600 of each (benchmarks/results/
            # engine-guards-cpu.md); were the entry gone (a reset of Dynamo), it refuses to
            # compile under this stance and the call below compiles again
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self.compiled(rows, kv_len, flags, None, self.key)
            except RuntimeError as err:
                if "skip_guard_eval_unsafe" not in str(err):
                    raise
        out = self.compiled(rows, kv_len, flags, None, self.key)
        self.warm.add(bucket)
        return out

    def step(self, rows: int, kv_len: int, flags: tuple, adapters, key: int = 0):
        """``flags``: (sampling, penalty, filtering) of the running requests."""
        engine, st = self.engine, self.engine.state
        if key < 0:  # never: the test makes Dynamo guard on the key (unread, it would not)
            raise ValueError(key)
        pos, live = st.positions[:rows].clone(), st.live[:rows].clone()
        engine.cache.decode(rows, pos, kv_len)
        logits = engine.model(
            input_ids=st.tokens[:rows, None],
            position_ids=pos[:, None],
            attention_mask=_masks(engine, pos, kv_len),
            **{self.kwarg: engine.cache},
            use_cache=True,
            logits_to_keep=1,
            **_adapter_kwargs(engine, adapters),
        ).logits[:, -1]
        nxt = next_tokens(logits, st.params(slice(0, rows)), *flags)
        penalty = flags[1]
        step = st.step[:rows] + 1
        ended = (torch.isin(nxt, st.eos) & ~st.ignore_eos[:rows]) | (step >= st.budget[:rows])
        st.tokens[:rows] = torch.where(live, nxt, st.tokens[:rows])
        st.positions[:rows] = pos + live.long()
        st.step[:rows] = torch.where(live, step, st.step[:rows])
        if penalty:
            idx = torch.arange(rows, device=nxt.device)
            st.seen[idx, nxt] = st.seen[idx, nxt] | live
        st.live[:rows] = live & ~ended
        return torch.where(live, nxt, -1)


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


def decode_once(engine, rows, kv_len, flags: tuple, adapters, column: int) -> None:
    engine.state.out[:rows, column] = engine.stepper(rows, kv_len, flags, adapters)
