"""Choosing the next token on the device, for a batch of requests that each sample differently.

Each row has its own temperature, top-k, top-p, repetition penalty and seed as tensors, so one
kernel sequence serves a mixed batch and nothing is read back to the host. The order and the
meaning of the filters are transformers' (repetition penalty, temperature, top-k, top-p).

Randomness is counter-based: the noise of token t at a request's step s is a hash of (seed, s, t),
and the token is the Gumbel-max ``argmax(logit / T + G)`` over the tokens the filters keep — an
exact draw from the filtered softmax. A request's output therefore depends on its seed alone, not on
which slot it sits in, what else is in the batch, or a generator's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


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


def next_tokens(
    logits: torch.Tensor, p: RowParams, sampling: bool, penalty: bool, filtering: bool = True
) -> torch.Tensor:
    """The next token of each row. ``sampling``/``penalty``/``filtering``: whether any row samples,
    penalises, or uses top-k/top-p (known on the host), so a greedy batch pays for no noise and an
    unfiltered one (GRPO's) for no sort of the vocabulary."""
    logits = logits.float()
    if penalty:
        pen = p.penalty[:, None]
        logits = torch.where(p.seen, torch.where(logits < 0, logits * pen, logits / pen), logits)
    greedy = first_argmax(logits)
    if not sampling:
        return greedy
    scaled = logits / p.temperature.clamp_min(1e-6)[:, None]
    if not filtering:
        vocab = torch.arange(scaled.shape[-1], device=scaled.device)[None]
        sampled = first_argmax(scaled + gumbel(p.seed, p.step, vocab))
        return torch.where(p.temperature == 0, greedy, sampled)
    ordered, order = scaled.sort(-1, descending=True)
    rank = torch.arange(ordered.shape[-1], device=ordered.device)[None]
    keep = (p.top_k[:, None] == 0) | (rank < p.top_k[:, None])
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = ordered.softmax(-1)
    # top-p: keep a token while the mass before it is under top_p (the first always stays)
    keep = keep & (((probs.cumsum(-1) - probs) < p.top_p[:, None]) | (rank == 0))
    noisy = ordered.masked_fill(~keep, float("-inf")) + gumbel(p.seed, p.step, order)
    sampled = order.gather(-1, first_argmax(noisy)[:, None])[:, 0]
    return torch.where(p.temperature == 0, greedy, sampled)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first index of each row's maximum. Inside a compiled step as the
    maximum, then the first index that holds it: two reductions inductor compiles to faster code
    than its argmax — on a CPU 296 against 439 µs a call over 16 x 32000 logits
    (benchmarks/results/engine-argmax-cpu.md); on a GPU inductor splits each of them over many
    programs, where it runs an argmax over a 128,256-token row as one (30 µs of a 1.6 ms step on
    an H200, benchmarks/results/h200-20261126/). A row of NaN gives the last index, not one past
    the end."""
    if not torch.compiler.is_compiling():
        return x.argmax(-1)
    index = torch.arange(x.shape[-1], device=x.device)
    first = torch.where(x == x.amax(-1, keepdim=True), index, x.shape[-1]).amin(-1)
    return first.clamp_max(x.shape[-1] - 1)


def gumbel(seed: torch.Tensor, step: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise for each (row, token): -log(-log(u)), u from a hash of (seed, step,
    token id). 32-bit mixing in int64, each product kept under 2**63 (31-bit multipliers)."""
    s = ((seed ^ (seed >> 32)) & _M32)[:, None]
    x = ((s * 0x7FEB352D) & _M32) ^ ((step[:, None] * 0x68E31DA5) & _M32)
    x = (x + ((token * 0x1B56C4E9) & _M32)) & _M32
    for mult in (0x6C8E9CF5, 0x2C1B3C6D):
        x = x ^ (x >> 16)
        x = (x * mult) & _M32
    x = x ^ (x >> 15)
    u = ((x >> 8).float() + 0.5) / float(1 << 24)  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))
