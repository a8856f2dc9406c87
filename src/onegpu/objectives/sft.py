"""Supervised fine-tuning (and pre-training): summed next-token cross-entropy over the target
tokens, normalised by the target tokens of the whole accumulated batch. Mixture-of-Experts models
add their router load-balancing loss (techniques/moe.moe_aux_term)."""

from __future__ import annotations

import torch

from onegpu.objectives.base import Objective
from onegpu.objectives.tokens import TARGETS, TokenLoss
from onegpu.techniques.moe import moe_aux_term


class SFT(Objective):
    """The causal-LM objective; no statistics beyond the loss, no reference."""

    def __init__(self, tokens: TokenLoss | None = None):
        self.tokens = tokens if tokens is not None else TokenLoss()

    def count(self, batch: dict) -> int:
        return batch[TARGETS].numel()

    def loss(self, model, batch: dict) -> torch.Tensor:
        out, loss = self.tokens.loss_sum(model, batch)
        return loss + moe_aux_term(model, out, batch["labels"][:, 1:])


def plain() -> SFT:
    """SFT with the plain loss: what a bare ``train_step`` trains with when given no objective."""
    return SFT(TokenLoss())


def loss_sum(model, batch: dict, chunk_size: int = 0, verify: bool = True) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (fp32 accumulation), plus the MoE router
    loss where the model has one; chunk_size > 0: the fused head, without fallback (``verify``: see
    TokenLoss)."""
    return SFT(TokenLoss(chunk_size, verify=verify)).loss(model, batch)
