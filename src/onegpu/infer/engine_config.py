"""The decode engine's settings, the facts about a model it starts from (context length, end
tokens, adapters), and what it refuses of a request."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Optional

from onegpu.errors import ConfigError
from onegpu.infer.requests import BASE


@dataclass
class EngineConfig:
    max_slots: int = 8
    """Sequences decoded together at most (decode rows). How many fit is the KV pool's to say:
    num_blocks."""
    max_len: Optional[int] = None
    """KV positions per sequence: prompt + new tokens must fit. Default: the model's context."""
    num_blocks: Optional[int] = None
    """Blocks in the KV pool (block 0 is reserved). Default: every row's worst case, max_slots
    x max_len positions, or with kv_budget what the memory holds."""
    kv_budget: bool = False
    """Size the pool from the memory left after the weights (infer/kv_budget.py: free GPU memory,
    or available RAM with a cap), capped at kv_memory, with num_blocks not given; max_len then
    defaults to the model's context up to 4,096. `onegpu serve`'s pool (its sizing is printed at
    start: Engine.pool_plan)."""
    kv_memory: Optional[float] = None
    """With kv_budget: GiB the pool may take at most."""
    block_size: int = 16
    """Positions per block (a power of two): the unit of allocation and of prefix sharing."""
    prefix_caching: bool = True
    """Keep finished sequences' full blocks, found again by a later request with the same
    prefix (and adapter), which then computes only the rest of its prompt."""
    compact_rows: bool = True
    """Keep the running sequences in the lowest rows: one that ends below another gives its row
    to the sequence of the highest row, so a decode step computes no empty row between live
    ones (off: sequences keep the row they were admitted to)."""
    token_budget: Optional[int] = None
    """Tokens one engine step computes: decode rows plus prompt pieces (default: the policy row
    cpu_token_budget's on a CPU, else max_len: a prompt in one piece)."""
    chunk: Optional[int] = None
    """The longest prompt piece; a prompt is computed in pieces ending at multiples of it, one or
    more per step. Default: the token budget."""
    compile: Literal["auto", "off", "on"] = "auto"
    """Compile the decode step (auto: on a GPU, as CUDA graphs; off on a CPU, where compiling
    costs a minute of start-up)."""
    compile_mode: Optional[str] = None
    """torch.compile mode (default: reduce-overhead on a GPU — CUDA graphs — default elsewhere)."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    sync_every: int = 8
    """Decode steps between read-backs to the host when no prompt is being computed (stop
    strings, streaming, new requests)."""
    flush_ms: Optional[float] = None
    """A read-back at least this often while decoding: fewer than sync_every decode steps run
    between read-backs where the steps are slow (measured as they run), so a stream's events come
    at least every flush_ms. None: sync_every steps always."""
    eos_ids: Optional[list[int]] = None
    """Tokens that end a sequence. Default: the model's generation config's, and the
    tokenizer's."""
    fixed_shape: bool = False
    """Every decode step runs all max_slots rows over all max_len positions: one compiled step
    (per sampling mode) whatever the requests' lengths, at the price of attending over the whole
    table. For callers whose requests are alike and who compile (GRPO's rollouts)."""
    speculative: Optional[str] = None
    """Speculative decoding: "ngram" (prompt lookup: each decode row proposes what followed the
    last tokens' most recent earlier occurrence, verified in one forward; the same tokens as
    without it), or None (off)."""
    num_speculative_tokens: int = 4
    """With speculative: the most tokens a row proposes per step (k; each step verifies k + 1
    positions of it)."""
    ngram_min: int = 2
    """With speculative ngram: the shortest suffix looked up."""
    ngram_max: int = 4
    """With speculative ngram: the longest suffix looked up (tried first)."""
    spec_min_accepted: float = 1.0
    """With speculative: the mean tokens accepted per verification (over a row's last
    spec_window) below which the row decodes plainly for a while before it proposes again (a
    verification costs more than a plain step: below what pays, it stops; the default's
    measurements: benchmarks/results/spec-verify-cost-cpu.md)."""
    spec_window: int = 4
    """With speculative: the verifications of a row spec_min_accepted averages over."""
    policy_off: list[str] = field(default_factory=list)
    """Rows of the device policy table (infer/policy.py) to switch off (`onegpu doctor` lists
    them)."""
    policy_on: list[str] = field(default_factory=list)
    """Rows to switch on where the table leaves them off: another device's row on this one (its
    code path tested or timed here), whatever it costs."""

    def check(self) -> None:
        ok = {
            "max_slots": self.max_slots >= 1,
            "sync_every": self.sync_every >= 1,
            "flush_ms": self.flush_ms is None or self.flush_ms > 0,
            "block_size": self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "token_budget": self.token_budget is None or self.token_budget >= 1,
            "chunk": self.chunk is None or self.chunk >= 1,
            "num_speculative_tokens": self.num_speculative_tokens >= 1,
            "ngram_min": 1 <= self.ngram_min <= self.ngram_max,
            "spec_min_accepted": self.spec_min_accepted >= 0,
            "spec_window": self.spec_window >= 1,
        }
        for name, good in ok.items():
            if not good:
                raise ConfigError(
                    f"engine {name} has an invalid value: {getattr(self, name)}.",
                    hint="max_slots, sync_every, token_budget, chunk, num_speculative_tokens, "
                    "spec_window >= 1; flush_ms > 0; block_size a power of two; "
                    "1 <= ngram_min <= ngram_max; spec_min_accepted >= 0",
                )
        if self.speculative not in (None, "ngram"):
            raise ConfigError(
                f"engine speculative has an invalid value: {self.speculative!r}.",
                hint='speculative "ngram" (prompt lookup), or None for off',
            )


def context_of(model) -> int:
    config = model.config
    if getattr(config, "vision_config", None) is not None:
        # a vision-language model: its language model's context; its images come with each
        # request (infer/images.py), for the families the engine runs
        from onegpu.infer.mrope import check_model

        check_model(model)
        config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(
        f"{type(model).__name__}: its config names no context length.",
        hint="pass the engine's max_len",
    )


def max_len_of(config: EngineConfig, model):
    """The engine's longest sequence (config.max_len, at most the model's context) and, with
    kv_budget and no num_blocks, the memory's sizing of the pool (kv_budget.KVPlan; its max_len
    defaults to the context up to 4,096), else None."""
    context = context_of(model)
    if not (config.kv_budget and config.num_blocks is None):
        return min(config.max_len or context, context), None
    from onegpu.infer.kv_budget import plan_kv
    from onegpu.infer.paged_cache import kv_bytes_per_position  # torch: once an engine is built

    plan = plan_kv(
        kv_bytes_per_position(model),
        context,
        str(model.get_input_embeddings().weight.device),
        config.max_len,
        config.max_slots,
        config.kv_memory,
        config.block_size,
    )
    return plan.max_len, plan


def eos_ids_of(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if (
        tokenizer is not None
        and tokenizer.eos_token_id is not None
        and tokenizer.eos_token_id not in ids
    ):
        ids.insert(0, tokenizer.eos_token_id)
    return ids


def check_request(engine, prompt_ids: list[int], params, adapter: Optional[str], images=None):
    """What ``engine`` refuses of a request before it queues, as a ConfigError naming it: a bad
    setting, an empty prompt or ids outside the vocabulary, a prompt and answer longer than the
    engine's limit, an unknown adapter, stop strings or a grammar it cannot apply, images for a
    text model or outside the prompt (infer/images.py). The images as the request runs them: with
    their rotary positions for an mrope family (infer/mrope.py)."""
    from onegpu.infer.images import check
    from onegpu.infer.mrope import with_rope

    params.check()
    check(engine.model, images, prompt_ids)
    if not prompt_ids:
        raise ConfigError("the prompt is empty.", hint="give at least one token")
    vocab, limit = engine.vocab, engine.max_len
    if not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
        raise ConfigError(
            f"the prompt holds token ids outside the model's vocabulary (0-{vocab - 1}):"
            f" {sorted({t for t in prompt_ids if not 0 <= t < vocab})[:5]}.",
            hint="encode the prompt with the model's own tokenizer",
        )
    need = len(prompt_ids) + params.max_new_tokens
    if need > limit:
        raise ConfigError(
            f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens "
            f"({params.max_new_tokens}) = {need} is over the engine's limit of {limit} tokens.",
            hint=f"shorten the prompt or lower max_new_tokens to {limit - len(prompt_ids)}",
        )
    check_adapter(engine.model, adapter)
    if params.stop and engine.tokenizer is None:
        raise ConfigError("stop strings need a tokenizer.", hint="give the engine one")
    if params.constraint is not None and not engine.features.constraints:
        raise ConfigError(
            "structured output needs a tokenizer and llguidance.",
            hint="give the engine a tokenizer; pip install 'onegpu[structured]'",
        )
    return with_rope(engine.model, images, prompt_ids)


def check_adapter(model, adapter: Optional[str]) -> None:
    if adapter is None or adapter == BASE:
        return
    known = list(getattr(model, "peft_config", {}) or {})
    if adapter not in known:
        raise ConfigError(
            f"adapter '{adapter}' is not loaded.",
            hint=f"use one of: {', '.join(known) or '(none: the model has no adapters)'}",
        )


@dataclass(frozen=True)
class Shapes:
    """The (rows, kv_len) a decode run of an engine runs over: ``rows`` decode rows at most, each
    of at most ``whole`` positions (max_len in whole blocks of ``block``)."""

    rows: int
    whole: int
    block: int
    fixed: bool  # EngineConfig.fixed_shape: always every row over every position
    compiled: bool

    def of(self, in_use: int, reach: int) -> tuple[int, int]:
        """For rows ``[0, in_use)`` whose steps reach ``reach`` positions: eager, the rows in use
        and the positions reached in whole 64s (a shape costs nothing to change); compiled, a
        few buckets of both (not of the requests' final lengths)."""
        grain = max(64, self.block)
        if self.fixed:
            return self.rows, self.whole
        if not self.compiled:
            return in_use, min(-(-reach // grain) * grain, self.whole)
        return bucket(in_use, self.rows), bucket(reach, self.whole, grain)

    def count(self) -> int:
        """The compiled steps an engine can ask for: (rows, kv_len) buckets x every kind of
        sampling.Needs (each of its fields on or off), the recompile limit it needs."""
        from onegpu.infer.sampling import Needs  # torch's import: only once an engine is built

        return len(self.buckets()) * 2 ** len(fields(Needs))

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, kv_len) a compiled decode run can ask for, smallest first (a warm-up
        compiles each before the first request)."""
        if self.fixed:
            return [(self.rows, self.whole)]
        rows = sorted({bucket(n, self.rows) for n in _powers(self.rows)})
        kv = sorted({bucket(n, self.whole, max(64, self.block)) for n in _powers(self.whole)})
        return [(r, k) for r in rows for k in kv]


def pool_blocks(config: EngineConfig, max_len: int, planned=None) -> tuple[int, int]:
    """The pool's blocks (config.num_blocks, else those of ``planned``, the memory's sizing
    (kv_budget.KVPlan), else every row's worst case and the null block) and a sequence's most;
    a pool that cannot hold one sequence of max_len is refused."""
    size = config.block_size
    per_seq = -(-max_len // size)
    memory = planned.num_blocks if planned is not None else None
    blocks = config.num_blocks or memory or config.max_slots * per_seq + 1
    if blocks - 1 < per_seq:
        raise ConfigError(
            f"engine: {blocks} KV blocks of {size} positions hold less than one sequence of "
            f"max_len {max_len} ({per_seq} blocks and the reserved one).",
            hint=f"num_blocks >= {per_seq + 1}, or a lower max_len",
        )
    return blocks, per_seq


def _powers(cap: int) -> list[int]:
    """1, 2, 4, ... and cap: one count in each power-of-two bucket up to cap."""
    out, n = [cap], 1
    while n < cap:
        out.append(n)
        n *= 2
    return out


def bucket(n: int, cap: int, start: int = 1) -> int:
    """The smallest power-of-two multiple of ``start`` that holds ``n``, at most ``cap``: a few
    fixed shapes, so a compiled step is reused instead of recompiled for every count."""
    size = start
    while size < n:
        size *= 2
    return min(size, cap)
