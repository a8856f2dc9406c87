"""GRPO's formulas: group-relative advantages and the clipped, per-token policy loss, as TRL's
GRPOTrainer computes them (trl 1.16: ``_generate_and_score_completions`` and ``_compute_loss``),
written over the flat target tokens of a batch (the order of tokens.with_target_positions).

Per token t of completion i, with r = exp(logp - logp_old) (GSPO, importance_sampling_level
sequence: r = exp of the mean of completion i's log-ratios, the same for each of its tokens), A_i
the completion's advantage:
    loss_t = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) + beta KL_t,
    KL_t = exp(ref - logp) - (ref - logp) - 1   (Schulman's k3 estimator, as in DeepSeekMath),
    times r with grpo.kl_ratio (TRL's default since DeepSeek-V3.2's unbiased KL gradient).
A micro-batch returns its loss *summed* as the loss type aggregates it; the step divides by the
count of the whole accumulated batch (``count``), which gives TRL's normalisation:
    dapo: sum over tokens / tokens of the step;
    grpo: sum over completions of (their mean over tokens) / completions of the step;
    dr_grpo: sum over tokens / (completions of the step x max_completion_length).
"""

from __future__ import annotations

import torch

EPS_STD = 1e-4  # TRL's: advantages = (r - mean) / (std + 1e-4)


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Rewards (NaN = not scored) minus their group's mean, divided by the group's (scale=group)
    or the batch's (batch) unbiased std, or not divided (none); NaN advantages become 0. Rows are
    whole groups of ``group`` consecutive completions."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    adv = (grouped - mean).reshape(-1)
    if scale == "group":
        adv = adv / (_nanstd(grouped, dim=1).repeat_interleave(group) + EPS_STD)
    elif scale == "batch":
        adv = adv / (_nanstd(rewards.reshape(1, -1), dim=1) + EPS_STD)
    # A group of equal rewards says nothing: exactly 0, not the fp32 rounding of its mean (8 x 0.7
    # leaves 6e-8, which the std of 6e-8 would scale to 6e-4 of one sign; TRL keeps that).
    hi = torch.where(grouped.isnan(), -torch.inf, grouped).amax(1)
    lo = torch.where(grouped.isnan(), torch.inf, grouped).amin(1)
    adv = adv.masked_fill((hi == lo).repeat_interleave(group), 0.0)
    return torch.nan_to_num(adv, nan=0.0)


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std ignoring NaNs (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim=dim).float()
    var = torch.nanmean((x - mean) ** 2, dim=dim) * n / (n - 1)
    return var.sqrt()


def per_token_loss(
    logps,
    old_logps,
    ref_logps,
    adv_tok,
    eps_low: float,
    eps_high: float,
    beta: float,
    kl_ratio: bool = True,
    rows: torch.Tensor | None = None,
    n_rows: int = 0,
    sampler_ratio: torch.Tensor | None = None,
):
    """(per-token loss, per-token KL or None, per-token clipped flag) over the target tokens;
    ``kl_ratio``: the KL term weighted by the ratio (grpo.kl_ratio); ``rows`` (each token's
    completion) and ``n_rows``: one ratio per completion (GSPO), else one per token;
    ``sampler_ratio``: the sampler correction's weight per token (``sampler_ratio``), applied to
    the policy term before the KL term is added, as TRL."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if rows is not None:  # TRL's: (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        sums = log_ratio.new_zeros(n_rows).index_add(0, rows, log_ratio)
        counts = log_ratio.new_zeros(n_rows).index_add(0, rows, torch.ones_like(log_ratio))
        log_ratio = (sums / counts.clamp(min=1.0)).index_select(0, rows)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * adv_tok, clipped * adv_tok)
    if sampler_ratio is not None:
        loss = loss * sampler_ratio
    kl = None
    if beta:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        loss = loss + beta * (kl * ratio if kl_ratio else kl)
    region = ((ratio < 1 - eps_low) & (adv_tok < 0)) | ((ratio > 1 + eps_high) & (adv_tok > 0))
    return loss, kl, region.detach()


def sampler_ratio(old, sampled, rows, n_rows: int, mode: str, level: str, cap: float):
    """TRL's vLLM importance-sampling weight per token (``_generate_and_score_completions``):
    r = exp(logp_old - logp_sampler) per token, or per completion from the sum of its tokens'
    differences (level sequence), truncated at ``cap`` (tis) or set to 0 above it (mis); no
    gradient."""
    diff = (old - sampled).detach()
    if level == "sequence":
        diff = diff.new_zeros(n_rows).index_add(0, rows, diff).index_select(0, rows)
    ratio = torch.exp(diff)
    if mode == "tis":
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def sampler_mismatch(train, sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums [tokens, sum |logp_train - logp_sampler|, sum of k3 KL(sampler || train)], max
    |difference|) over the target tokens, no gradient: the sampler-trainer mismatch."""
    d = (train - sampled).detach()
    k3 = torch.exp(d) - d - 1
    n = d.new_tensor(float(d.numel()))
    big = d.abs().max() if d.numel() else d.new_zeros(())
    return torch.stack([n, d.abs().sum(), k3.sum()]), big


def aggregate(loss_tok: torch.Tensor, rows: torch.Tensor, n_rows: int, loss_type: str):
    """The micro-batch's summed loss: token sum (dapo, dr_grpo) or the sum over completions of
    their token mean (grpo). ``rows``: each token's completion (row) index."""
    if loss_type != "grpo":
        return loss_tok.sum()
    sums = loss_tok.new_zeros(n_rows).index_add(0, rows, loss_tok)
    counts = loss_tok.new_zeros(n_rows).index_add(0, rows, torch.ones_like(loss_tok))
    return (sums / counts.clamp(min=1.0)).sum()


def count(loss_type: str, tokens: int, rows: int, max_completion_length: int) -> int:
    """What the step divides the summed losses of all micro-batches by."""
    if loss_type == "dapo":
        return tokens
    if loss_type == "grpo":
        return rows
    return rows * max_completion_length
