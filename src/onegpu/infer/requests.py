"""What callers hand the decode engine and what it hands back: one request's sampling settings, and
the news of a request after each engine step. No torch here: the server and the CLI build these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Optional

from onegpu.errors import ConfigError

if TYPE_CHECKING:  # sampling.py holds torch, which this module does not import
    from onegpu.infer.sampling import Needs

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
# the adapter name of a request on the base model of a model with adapters (PEFT's name for a row
# that takes none): the one name, used by the engine, batched LoRA and the server
BASE = "__base__"


@dataclass(frozen=True)
class Constraint:
    """A grammar the request's tokens must follow (``infer.constraints`` compiles it with the
    tokenizer). ``kind``: json_schema (``value``: the schema as JSON text; "" for any JSON object),
    regex, choice (``value``: a JSON list of strings, one of which is the answer) or grammar (a
    Lark grammar, llguidance's dialect, or llama.cpp's GBNF). ``before`` / ``after``: literal text
    around the JSON (a tool call's tags)."""

    kind: Literal["json_schema", "regex", "choice", "grammar"]
    value: str
    before: str = ""
    after: str = ""


@dataclass(frozen=True)
class EngineFeatures:
    """What an engine applies beyond temperature, top-k/top-p, repetition penalty, seed and stop
    strings. A server refuses a request that asks for more, naming the field, rather than answer
    as if it had been applied."""

    penalties: bool = False
    """presence_penalty and frequency_penalty (``infer.logit_rules.apply_penalties``)."""
    logprobs: bool = False
    """Update.logprobs for requests with ``logprobs`` set (``infer.logit_rules.token_logprobs``)."""
    constraints: bool = False
    """Token masks from a request's Constraint (``infer.constraints``)."""
    bias: bool = False
    """logit_bias and min_tokens (``infer.logit_rules.apply_bias``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. temperature 0 is greedy (the most likely token each step)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = (
        1.0  # 1 = off; as transformers: divide positive scores, multiply negative
    )
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings, cut from the text
    ignore_eos: bool = False  # decode exactly max_new_tokens (benchmarks)
    # OpenAI's: subtract presence_penalty once and frequency_penalty per earlier occurrence from
    # the logit of each token the request has generated (not its prompt's), both 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None  # None: none; k: each token's logprob and the k likeliest
    # None: none; k: each prompt token's logprob and the k likeliest there (completions' echo;
    # the whole prompt is computed, none of it taken from the prefix cache)
    prompt_logprobs: Optional[int] = None
    constraint: Optional[Constraint] = None
    # OpenAI's logit_bias: (token id, bias in -100..100) pairs added to those tokens' logits
    # before any sampling (greedy included), after the presence/frequency penalties
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS (the engine's EOS ids) is masked until this many are generated

    def check(self, field_prefix: str = "") -> None:
        """One clear error naming the bad field (``field_prefix`` + name: "--top_p", "top_p")."""
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature >= 0,
            "top_k": self.top_k >= 0,
            "top_p": 0 < self.top_p <= 1,
            "repetition_penalty": self.repetition_penalty > 0,
            "seed": 0 <= self.seed < 2**63,
            "presence_penalty": -2 <= self.presence_penalty <= 2,
            "frequency_penalty": -2 <= self.frequency_penalty <= 2,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "prompt_logprobs": self.prompt_logprobs is None
            or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "logit_bias": all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
            "min_tokens": 0 <= self.min_tokens <= self.max_new_tokens,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"{field_prefix}{name} has an invalid value: {getattr(self, name)}.",
                    hint="max_new_tokens >= 1; temperature, top_k >= 0; 0 < top_p <= 1; "
                    "repetition_penalty > 0; 0 <= seed < 2**63; -2 <= presence_penalty, "
                    f"frequency_penalty <= 2; 0 <= logprobs, prompt_logprobs <= {MAX_LOGPROBS}; "
                    "logit_bias: token ids >= 0, biases in -100..100; "
                    "0 <= min_tokens <= max_new_tokens",
                )
        if any(not s for s in self.stop):
            raise ConfigError(
                f"{field_prefix}stop contains an empty string.",
                hint="remove it; an empty stop string would stop at once",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Update:
    """What happened to one request during an engine step: the tokens it produced (``token_ids``)
    and the text that may be shown now (``text``: held back while it could still become a stop
    string or ends in half a character). ``finished`` comes once, with the reason."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    generated_tokens: int = 0  # so far, in all
    first_token: bool = False  # this update carries the request's first token
    logprobs: Optional[list[TokenLogprob]] = None  # one per token_ids entry, when asked for
    # with the first token, when asked for: one per prompt token (the first None: nothing
    # precedes it)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    error: Optional[str] = (
        None  # this request alone failed (finished, reason "error"); others go on
    )


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the ``k`` likeliest tokens of
    that step with theirs (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Result:
    """A finished request, as ``Engine.generate`` returns it."""

    token_ids: list[int]  # the generated tokens (up to and including EOS, before a stop string cut)
    text: str  # the generated text, without special tokens, cut before a stop string
    finish_reason: FinishReason
    prompt_tokens: int


class DecodeShape(NamedTuple):
    """The decode steps an engine ran over one (rows, kv_len) shape: ``steps`` of them, and
    ``reach``, the furthest position a row of theirs could write (a row that finished within a run
    writes no further): always below ``kv_len``, the view a step reads covers its writes."""

    rows: int
    kv_len: int
    steps: int
    reach: int


@dataclass
class EngineStats:
    """The engine's load and totals after a step (the server's metrics), and how it decodes:
    the shapes its steps ran and compiled, the policy rows it applies, its decode attention."""

    running: int
    waiting: int
    kv_positions_used: int  # positions of the blocks held by sequences
    kv_positions_total: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, in all
    prefix_hits: int = 0  # of them found there
    preemptions: int = 0  # sequences preempted (recomputed later), in all
    compiles: int = 0  # decode-step shapes compiled after the warm-up (each stalls every stream)
    compile_s: float = 0.0  # their seconds
    kv_bytes: int = 0  # the KV pool's memory as allocated so far (its layers are made lazily)
    decode_steps: int = 0  # decode steps run, in all
    decode_rows: int = 0  # rows those steps computed, in all (empty rows of a bucket included)
    grammar_s: float = 0.0  # host seconds spent on grammars: masks made, tokens accepted
    # speculative decoding (vLLM's spec_decode counters): verifications run, tokens proposed,
    # tokens accepted, and accepted by position (index i: the (i + 1)-th proposal of a row)
    spec_drafts: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    prefill_forwards: int = 0  # forwards of prompt pieces (speculative verifications too), in all
    prefill_tokens: int = 0  # the positions those forwards computed (a batch's padding included)
    # rows whose KV an eager forward copied out of the pool's blocks (all layers, keys and
    # values): with the eager_window row once a sequence as it starts decoding, without it at
    # every decode step; a piece reading earlier blocks too. A compiled step's reads are
    # inductor's (in place, or fused into its graph) and not counted
    kv_gathers: int = 0
    batched_lora_steps: int = 0  # decode steps whose rows took their adapters by index
    # of decode_rows, those holding a sequence that decodes in the step's run (one finishing
    # within a run counted to its end); the rest is a bucket's padding and idle rows
    decode_live_rows: int = 0
    decode_shapes: tuple[DecodeShape, ...] = ()  # by shape, in the order first run
    # the (rows, kv_len, needs) decode steps compiled and run so far, the warm-up's included: a
    # step of one of these shapes runs without compiling
    compiled_shapes: frozenset[tuple[int, int, Needs]] = frozenset()
    policy_rows: tuple[str, ...] = ()  # the rows of infer/policy.py this engine applies
    # matmuls its compiled step's graph pass made inductor reductions (small_gemv.py: the
    # small_gemv and cpu_head_reduction rows), over every graph compiled so far
    matmul_rewrites: int = 0
    decode_attention: str = ""  # the attention its decode steps run (cpu_attention.NAME, "sdpa")
