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

from onegpu.infer.logit_rules import (
    apply_bias,
    apply_penalties,
    apply_token_bitmask,
    token_logprobs,
)

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Needs:
    """What the rows of a step ask for beyond the most likely token, known on the host: it keys a
    compiled step, so a greedy batch pays for no noise, an unpenalised one for no lookup of the
    tokens seen or counted, an unfiltered one (GRPO's) for no sort of the vocabulary, one that
    asks for no logprobs for no log-softmax, one without a grammar for no token mask. A new
    per-row feature is one more field here, one more per-row tensor in ``rows.Rows`` and one more
    stage in ``next_tokens``: the step's shape does not change."""

    sampling: bool = False
    penalty: bool = False  # transformers' repetition penalty
    filtering: bool = False
    penalties: bool = False  # OpenAI's presence/frequency penalties: counts of generated tokens
    logprobs: bool = False  # the chosen tokens' logprobs and the MAX_LOGPROBS likeliest
    constraints: bool = False  # a grammar's allowed tokens: Rows.bitmask
    biased: bool = False  # logit_bias or min_tokens: Rows.bias, Rows.min_tokens

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


def sample(logits: torch.Tensor, p: RowParams, needs: Needs) -> torch.Tensor:
    """The next token of each row of ``logits`` under its settings ``p`` (rows.Rows.params, the
    grammar's masks among them): what ``needs`` asks for of ``next_tokens``. Pure: it writes
    nothing."""
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


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, needs: Needs, top: int):
    """The logprob of each row's chosen token under the model's own ``logits`` (before any
    penalty, temperature or filter: vLLM's default) and the ``top`` likeliest tokens with
    theirs: ([rows], [rows, top], [rows, top]); None when no row asks. ``top`` is fixed (the
    most a request may ask for), so one compiled step serves every request's k."""
    if not needs.logprobs:
        return None
    return token_logprobs(logits, tokens, top)


def speculative_accept(targets: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """The speculative acceptance rule: how many of each row's ``proposals`` ``[rows, k]`` are
    kept, given the target's own tokens ``targets`` ``[rows, k + 1]`` (position i drawn, by
    ``next_tokens`` under the row's settings, from the logits that follow the proposals before
    i). A row keeps the longest prefix where the target's token equals the proposal, then the
    target's token at the first mismatch (or its bonus token after all k): its new tokens are
    ``targets[:, : accepted + 1]``.

    Greedy, the target's token is its argmax. Sampled, it is the row's inverse-CDF draw with the
    noise of that position (the row's counter, as plain decoding has it there). For a proposer
    that puts all its mass on one token x (prompt lookup), this is the standard speculative
    rejection sampler: x is accepted with probability p(x) (the draw lands on x), and on
    rejection the token is the draw itself, which is distributed as p with x's mass removed and
    renormalised (max(0, p - q) normalised, with q a point mass). So every position's token
    follows the target's distribution, and with the same seed the tokens are plain decoding's."""
    match = (targets[:, :-1] == proposals).long()
    return match.cumprod(-1).sum(-1)
