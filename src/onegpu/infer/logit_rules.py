"""Per-request rules on a decode step's logits, batched over rows and run on the logits' device:
OpenAI's presence and frequency penalties and logit_bias, min_tokens' EOS mask, the
log-probabilities of the chosen tokens (and each row's likeliest alternatives), and a grammar's
token mask.

Pure tensor functions, no state: the engine keeps, per row, the counts of the tokens the request
generated (``count_tokens`` adds a step's tokens) and calls, in its sampler,
``apply_penalties`` -> ``apply_bias`` -> ``apply_token_bitmask`` -> (temperature, top-k/top-p,
draw) -> ``token_logprobs`` on the logits before any of these rules (vLLM's default: the model's own
distribution). Rows that ask for nothing are left exactly as they were (their penalty is 0, their
bitmask row is all ones)."""

from __future__ import annotations

from typing import Optional

import torch


def count_tokens(
    counts: torch.Tensor,
    tokens: torch.Tensor,
    live: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``counts`` [rows, vocab] (any integer or float dtype) plus one at each row's new token,
    for the rows where ``live`` [rows] (bool) is set; in place, and returned. ``rows``: the rows of
    ``counts`` the tokens are for (distinct indices), when not the first ``len(tokens)``."""
    if rows is None:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
    counts.index_put_((rows, tokens), live.to(counts.dtype), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's definition: ``logit[j] - count[j] * frequency - (count[j] > 0) * presence``, per row
    (``presence``/``frequency`` [rows]; ``counts`` [rows, vocab]: the row's generated tokens, not
    its prompt). A new tensor; the dtype of ``logits`` is kept."""
    c = counts.to(logits.dtype)
    return (
        logits
        - c * frequency[:, None].to(logits.dtype)
        - (c > 0) * presence[:, None].to(logits.dtype)
    )


def apply_bias(
    logits: torch.Tensor, bias: torch.Tensor, early: torch.Tensor, eos: torch.Tensor
) -> torch.Tensor:
    """OpenAI's logit_bias and vLLM's min_tokens, per row: ``bias`` [rows, vocab] added to the
    logits, and where ``early`` [rows] (the row has generated fewer than its min_tokens) each EOS
    token (``eos``: their ids, [k] long) at -inf. A row with no bias and not early keeps its
    values (+0.0, its EOS columns written back as they were). A new tensor. The mask touches the
    k EOS columns alone, not the whole [rows, vocab]: on a CPU a where over all of it cost as much
    as the add (benchmarks/results/sampling-rules-stage-cpu.md)."""
    logits = logits + bias.to(logits.dtype)
    if eos.numel():
        logits[:, eos] = torch.where(early[:, None], float("-inf"), logits[:, eos])
    return logits


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probability of each row's chosen token under ``logits`` ([rows, vocab], computed in
    fp32), and the ``k`` likeliest tokens with theirs, most likely first: ([rows], [rows, k] ids,
    [rows, k] logprobs). ``k`` is the batch's largest top_logprobs (a row that asked for fewer
    keeps the first of them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None].long())[:, 0]
    top_lp, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_lp


def bitmask_words(vocab: int) -> int:
    """int32 words per row of a token bitmask (bit ``t % 32`` of word ``t // 32`` allows ``t``)."""
    return (vocab + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool (True: allowed). Tokens past ``words * 32`` (a
    model whose embedding is padded past its tokenizer) are not allowed. Through the bytes of the
    words (little-endian, as on x86 and CUDA devices: token t is bit t % 8 of byte t // 8) and a
    256 x 8 table: one gather, not 32 shifts of every word (about 20% faster on a CPU)."""
    table = (
        torch.arange(256, device=bitmask.device)[:, None] >> torch.arange(8, device=bitmask.device)
    ) & 1
    allowed = table.bool()[bitmask.contiguous().view(torch.uint8).long()].flatten(1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad.to(allowed.device)], dim=1)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``logits`` with every token a row's bitmask does not allow set to -inf (a new tensor). The
    bitmask is [rows, bitmask_words(vocab)] int32 on the logits' device, an unconstrained row all
    ones (-1), which comes back unchanged. ``rows``: the indices of the constrained rows, when the
    bitmask holds only theirs; the other rows are not touched at all (the mask's cost is then
    paid per constrained row, not per batch row)."""
    if rows is None:
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
        return torch.where(allowed, logits, float("-inf"))
    out = logits.clone()
    out[rows] = apply_token_bitmask(logits[rows], bitmask)
    return out
