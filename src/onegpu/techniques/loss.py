"""Causal-LM loss as a *sum* over target tokens, so the loop can normalise by the real token count
of the whole accumulated batch (transformers#34191: per-micro-batch means weight tokens unevenly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: labels shifted by one, -100 excluded."""
    return int((labels[:, 1:] != IGNORE).sum())


def loss_sum(model, batch: dict, chunk_size: int = 0) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (fp32 accumulation)."""
    out = model(**model_inputs(batch))
    logits = out.logits[:, :-1, :]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
