"""Choosing the next token on the device, for a batch of requests that each sample differently.

Each row has its own temperature, top-k, top-p, repetition penalty and seed as tensors, so one
kernel sequence serves a mixed batch and nothing is read back to the host. The order and the
meaning of the filters are transformers' (repetition penalty, temperature, top-k, top-p).

Randomness is counter-based: a request's step s draws one uniform number u, a hash of (seed, s),
and the token is where u falls in the cumulative distribution of the tokens the filters keep (the
inverse CDF) — an exact draw from the filtered softmax. A request's output therefore depends on its
seed alone, not on which slot it sits in, what else is in the batch, or a generator's state. One
number a row, not a noise value for each of the vocabulary's tokens: the Gumbel-max draw this
replaced hashed each token's noise in 64-bit integers, which an AVX2 CPU multiplies one at a time.
GRPO's rollouts, compiled engine, one thread (benchmarks/results/grpo-rollouts-cpu.md): 2.15x and
2.02x ``generate``'s tokens/s with this draw, 1.93x and 1.84x with the Gumbel one (a separate run,
same command).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from onegpu.errors import ConfigError
from onegpu.infer.logit_rules import (
    apply_bias,
    apply_penalties,
    apply_token_bitmask,
    bitmask_words,
    count_tokens,
    token_logprobs,
)
from onegpu.infer.requests import MAX_LOGPROBS

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Needs:
    """What the rows of a step ask for beyond the most likely token, known on the host: it keys a
    compiled step, so a greedy batch pays for no noise, an unpenalised one for no lookup of the
    tokens seen or counted, an unfiltered one (GRPO's) for no sort of the vocabulary, one that
    asks for no logprobs for no log-softmax, one without a grammar for no token mask. A new
    per-row feature is one more field here, one more per-row tensor in ``Sampler`` and one more
    stage in ``next_tokens``: the step's shape does not change."""

    sampling: bool = False
    penalty: bool = False  # transformers' repetition penalty
    filtering: bool = False
    penalties: bool = False  # OpenAI's presence/frequency penalties: counts of generated tokens
    logprobs: bool = False  # the chosen tokens' logprobs and the MAX_LOGPROBS likeliest
    constraints: bool = False  # a grammar's allowed tokens: Sampler.bitmask
    biased: bool = False  # logit_bias or min_tokens: Sampler.bias, Sampler.min_tokens

    @classmethod
    def of(cls, params) -> Needs:
        """The needs of a batch of requests' SamplingParams."""
        return cls(
            any(not p.greedy for p in params),
            any(p.repetition_penalty != 1.0 for p in params),
            any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params),
            any(p.logprobs is not None for p in params),
            any(p.constraint is not None for p in params),
            any(p.logit_bias or p.min_tokens for p in params),
        )


@dataclass
class RowParams:
    """Per-row sampling settings on the device, [rows] each (``seen``: [rows, vocab])."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    penalty: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor  # tokens the request generated so far: the noise's counter
    seen: torch.Tensor  # tokens of the prompt and the output so far (repetition penalty)
    # OpenAI's penalties ([rows]) and the counts of the tokens each request generated [rows, vocab]
    presence: Optional[torch.Tensor] = None
    frequency: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None
    # each row's allowed tokens [rows, bitmask_words(vocab)] int32 (all ones: every token), and
    # which rows hold a grammar's mask [rows] (bool)
    bitmask: Optional[torch.Tensor] = None
    masked: Optional[torch.Tensor] = None
    # OpenAI's logit_bias [rows, vocab] (0: none), each row's min_tokens [rows] and the EOS ids
    # [k] (long): masked while a row's step is under its min_tokens
    bias: Optional[torch.Tensor] = None
    min_tokens: Optional[torch.Tensor] = None
    eos: Optional[torch.Tensor] = None


def next_tokens(
    logits: torch.Tensor,
    p: RowParams,
    sampling: bool,
    penalty: bool,
    filtering: bool = True,
    penalties: bool = False,
    constraints: bool = False,
    biased: bool = False,
) -> torch.Tensor:
    """The next token of each row. ``sampling``/``penalty``/``filtering``/``penalties``/
    ``constraints``: whether any row samples, applies the repetition penalty, uses top-k/top-p,
    OpenAI's presence and frequency penalties, a grammar's token mask, or logit_bias/min_tokens
    (known on the host), so a greedy batch pays for no noise, an unfiltered one (GRPO's) for no
    sort of the vocabulary, an unpenalised one for no pass over the counts, an unconstrained one
    for no mask and an unbiased one for no add. The penalties come before the bias, the bias
    before the masks (min_tokens', the grammar's) and the masks before temperature and the
    filters, the repetition penalty first (vLLM's order); greedy rows take the argmax after all
    of them."""
    logits = logits.float()
    if penalty:
        pen = p.penalty[:, None]
        logits = torch.where(p.seen, torch.where(logits < 0, logits * pen, logits / pen), logits)
    if penalties:  # a row with both 0 subtracts 0: its logits stay bit for bit what they were
        logits = apply_penalties(logits, p.counts, p.presence, p.frequency)
    if biased:  # a row with no bias adds 0 and masks nothing past its min_tokens
        logits = apply_bias(logits, p.bias, p.step < p.min_tokens, p.eos)
    if constraints:
        logits = mask_rows(logits, p.bitmask, p.masked)
    greedy = first_argmax(logits)
    if not sampling:
        return greedy
    scaled = logits / p.temperature.clamp_min(1e-6)[:, None]
    u = uniform(p.seed, p.step)
    if not filtering:
        sampled = draw((scaled - scaled.amax(-1, keepdim=True)).exp(), u, greedy)
        return torch.where(p.temperature == 0, greedy, sampled)
    ordered, order = scaled.sort(-1, descending=True)
    rank = torch.arange(ordered.shape[-1], device=ordered.device)[None]
    keep = (p.top_k[:, None] == 0) | (rank < p.top_k[:, None])
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = ordered.softmax(-1)
    # top-p: keep a token while the mass before it is under top_p (the first always stays)
    keep = keep & (((probs.cumsum(-1) - probs) < p.top_p[:, None]) | (rank == 0))
    best = torch.zeros_like(greedy)  # the most likely kept token: the first of the order
    sampled = order.gather(-1, draw(probs.masked_fill(~keep, 0.0), u, best)[:, None])[:, 0]
    return torch.where(p.temperature == 0, greedy, sampled)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens each row's grammar does not allow at -inf. Compiled, every row
    at once: fixed shapes, one step whatever the number of constrained rows (a row without a
    grammar is all ones, and torch.where keeps each of its logits bit for bit). Eager on a CPU,
    only the rows ``masked`` marks, the others not touched: one row of a 32k vocabulary unpacked
    and applied, not eight (benchmarks/results/constraint-cost-cpu.md). Eager on a GPU every row
    too: finding the marked rows (``nonzero``) would wait for the device at every step."""
    if torch.compiler.is_compiling() or logits.device.type != "cpu":
        return apply_token_bitmask(logits, bitmask)
    rows = masked.nonzero()[:, 0]
    return apply_token_bitmask(logits, bitmask[rows], rows=rows)


def draw(weights: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Each row's index i with ``cum[i - 1] <= u * total < cum[i]`` over ``weights`` (>= 0, not all
    0; ``cum`` their running sum): a draw from weights / total for u uniform in (0, 1). In two
    levels — blocks of 64 tokens, then the tokens of the block that holds the target — so no running
    sum spans the vocabulary: shorter sums round less, and a compiled step vectorises them. A token
    of weight 0 is never drawn: where rounding would land on one (the block's own sum and the sum of
    its tokens differing in the last bit), the row takes ``fallback``."""
    rows, vocab = weights.shape
    width = 64
    w = torch.nn.functional.pad(weights, (0, -vocab % width)).view(rows, -1, width)
    totals = w.sum(-1).cumsum(-1)  # [rows, blocks]: the mass up to each block's end
    target = u[:, None] * totals[:, -1:]
    block = (totals <= target).sum(-1).clamp_max(totals.shape[-1] - 1)
    before = totals.gather(1, (block - 1).clamp_min(0)[:, None])[:, 0].where(block > 0, 0.0)
    inner = w.gather(1, block[:, None, None].expand(rows, 1, width))[:, 0].cumsum(-1)
    index = block * width + ((inner + before[:, None]) <= target).sum(-1).clamp_max(width - 1)
    index = index.clamp_max(vocab - 1)
    return torch.where(weights.gather(1, index[:, None])[:, 0] > 0, index, fallback)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first index of each row's maximum. Inside a compiled step as the
    maximum, then the first index that holds it: two reductions inductor compiles to faster code
    than its argmax — on a CPU 296 against 439 µs a call over 16 x 32000 logits
    (benchmarks/results/engine-argmax-cpu.md); on a GPU inductor splits each of them over many
    programs, where it runs an argmax over a 128,256-token row as one (30 µs of a 1.6 ms step on
    an H200, benchmarks/results/h200-20261126/). Eagerly as ``max(-1)``'s indices (the first
    index of the maximum too) on a CPU, 2-2.7x faster there than its argmax (24 x 32,000 logits
    on one thread: 0.49 against 1.24 ms; the same file; a GPU's eager argmax was not timed and is
    left as it was). A row of NaN gives the last index, not one past the end."""
    if not torch.compiler.is_compiling():
        return x.max(-1).indices if x.device.type == "cpu" else x.argmax(-1)
    index = torch.arange(x.shape[-1], device=x.device)
    first = torch.where(x == x.amax(-1, keepdim=True), index, x.shape[-1]).amin(-1)
    return first.clamp_max(x.shape[-1] - 1)


def uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) for each row from a hash of (seed, step): 32-bit mixing in
    int64, each product kept under 2**63 (31-bit multipliers); 23 bits of it, so that the float32
    number is never 0 or 1 (24 bits round their largest value up to 1.0)."""
    s = (seed ^ (seed >> 32)) & _M32
    x = ((s * 0x7FEB352D) & _M32) ^ ((step * 0x68E31DA5) & _M32)
    for mult in (0x6C8E9CF5, 0x2C1B3C6D):
        x = x ^ (x >> 16)
        x = (x * mult) & _M32
    x = x ^ (x >> 15)
    return unit(x)


def unit(x: torch.Tensor) -> torch.Tensor:
    """32-bit hash values -> float32 in (0, 1): the top 23 bits and a half, over 2**23."""
    return ((x >> 9).float() + 0.5) / float(1 << 23)


class Sampler:
    """Each decode row's sampling settings on the device, written when a request takes the row
    and read by every step: ``[rows]`` tensors, the tokens each row has seen ``[rows, vocab]``
    (prompt and output: the repetition penalty) and how often it generated each ``[rows, vocab]``
    (int32: OpenAI's presence and frequency penalties), and the tokens each row's grammar allows
    next ``bitmask [rows, ceil(vocab / 32)]`` (int32, all ones for a row without one) with
    ``masked [rows]`` marking the rows that hold one (the engine writes ``host_bitmask`` and
    ``host_masked``, ``upload_bitmask`` takes them to the device), each row's logit_bias
    ``[rows, vocab]`` (float, 0 where none) and min_tokens ``[rows]`` with the model's EOS ids
    (``eos [k]``, long: what min_tokens masks). What a token's draw counts
    from (the request's tokens so far) is the caller's, passed in."""

    def __init__(self, rows: int, vocab: int, device, eos: tuple[int, ...] = ()):
        def z(dtype, *shape, fill=0):
            return torch.full(shape or (rows,), fill, dtype=dtype, device=device)

        self.temperature = z(torch.float)
        self.top_k = z(torch.long)
        self.top_p = z(torch.float, fill=1.0)
        self.penalty = z(torch.float, fill=1.0)
        self.seed = z(torch.long)
        self.seen = z(torch.bool, rows, vocab)
        self.presence = z(torch.float)
        self.frequency = z(torch.float)
        self.counts = z(torch.int32, rows, vocab)
        self.bitmask = z(torch.int32, rows, bitmask_words(vocab), fill=-1)
        self.masked = z(torch.bool)
        self.bias = z(torch.float, rows, vocab)
        self.min_tokens = z(torch.long)
        ids = sorted({t for t in eos if 0 <= t < vocab})
        self.eos = torch.tensor(ids, dtype=torch.long).to(device)
        cuda = torch.device(device).type == "cuda"
        # the host's copies (on a CPU the device's own): a few KB a row, copied as the tables are
        self.host_bitmask = self.bitmask.cpu() if cuda else self.bitmask
        self.host_masked = self.masked.cpu() if cuda else self.masked
        self.top = min(MAX_LOGPROBS, vocab)  # alternatives computed per token, when asked
        if cuda:  # CUDA graphs replay on fixed addresses
            for name in self._STATE:
                torch._dynamo.mark_static_address(getattr(self, name))

    # a request's own, moved with it (``move``); the grammar's mask is written by every step
    _REQUEST = ("temperature", "top_k", "top_p", "penalty", "seed", "seen")
    _REQUEST += ("presence", "frequency", "counts", "bias", "min_tokens")
    _STATE = _REQUEST + ("bitmask", "masked", "eos")

    def start(self, row: int, params, tokens: list[int], generated: int = 0) -> None:
        """Row ``row`` now samples for a request with ``params`` whose tokens so far are
        ``tokens`` (its prompt, or prompt and output when it is recomputed after preemption), the
        last ``generated`` of them its output (what the presence/frequency penalties count)."""
        self.temperature[row], self.top_k[row] = params.temperature, params.top_k
        self.top_p[row], self.penalty[row] = params.top_p, params.repetition_penalty
        self.seed[row] = params.seed
        self.presence[row], self.frequency[row] = params.presence_penalty, params.frequency_penalty
        self.seen[row] = False
        if params.repetition_penalty != 1.0:
            self.seen[row, torch.tensor(tokens).to(self.seen.device)] = True
        self.counts[row] = 0
        if generated and (params.presence_penalty != 0 or params.frequency_penalty != 0):
            out = torch.tensor(tokens[len(tokens) - generated :])
            self.counts[row] = torch.bincount(out, minlength=self.counts.shape[1]).to(
                self.counts.device, torch.int32
            )
        self.bias[row] = 0.0
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            if max(ids) >= self.bias.shape[1]:
                raise ConfigError(
                    f"logit_bias names token {max(ids)}, past the model's vocabulary "
                    f"({self.bias.shape[1]} tokens).",
                    hint="bias ids of the model's own tokenizer",
                )
            self.bias[row, torch.tensor(ids).to(self.bias.device)] = torch.tensor(values).to(
                self.bias.device
            )
        self.min_tokens[row] = params.min_tokens

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s request samples in row ``dst`` from now on: its settings and the tokens
        it has seen and counted go with it (its draws follow its seed and its own counter, so
        they are the same in either row). A grammar's mask is written afresh by every step."""
        for name in self._REQUEST:
            t = getattr(self, name)
            t[dst] = t[src]

    def sample(self, logits: torch.Tensor, rows, counter: torch.Tensor, needs: Needs):
        """The next token of each of ``rows`` (a slice, or row indices) from its ``logits``;
        ``counter``: each row's tokens generated so far (its noise's counter)."""
        p = RowParams(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.penalty[rows],
            self.seed[rows],
            counter,
            self.seen[rows],
            self.presence[rows],
            self.frequency[rows],
            self.counts[rows] if needs.penalties else None,
            self.bitmask[rows] if needs.constraints else None,
            self.masked[rows] if needs.constraints else None,
            self.bias[rows] if needs.biased else None,
            self.min_tokens[rows],
            self.eos,
        )
        return next_tokens(
            logits,
            p,
            needs.sampling,
            needs.penalty,
            needs.filtering,
            needs.penalties,
            needs.constraints,
            needs.biased,
        )

    def upload_bitmask(self, rows: int) -> None:
        """The first ``rows`` rows of ``host_bitmask`` and ``host_masked`` to the device (the
        step reads them)."""
        if self.host_bitmask is not self.bitmask:
            self.bitmask[:rows].copy_(self.host_bitmask[:rows], non_blocking=True)
            self.masked[:rows].copy_(self.host_masked[:rows], non_blocking=True)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, needs: Needs):
        """The logprob of each row's chosen token under the model's own ``logits`` (before any
        penalty, temperature or filter: vLLM's default) and the ``top`` likeliest tokens with
        theirs: ([rows], [rows, top], [rows, top]); None when no row asks. ``top`` is fixed (the
        most a request may ask for), so one compiled step serves every request's k."""
        if not needs.logprobs:
            return None
        return token_logprobs(logits, tokens, self.top)

    def observe(self, rows: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor, needs: Needs):
        """Rows ``rows`` (indices) chose ``tokens`` (where ``live``): the penalties see them. The
        counts are only kept while a penalising row runs: a row that does not penalise multiplies
        its (stale) counts by 0, and a row that does has them kept at every step it runs."""
        if needs.penalty:
            self.seen[rows, tokens] = self.seen[rows, tokens] | live
        if needs.penalties:
            count_tokens(self.counts, tokens, live, rows)
