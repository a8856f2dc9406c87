"""Optimizer choice. Weight decay never touches biases or norm weights (1-D parameters)."""

from __future__ import annotations

import torch

from onegpu.config import TechniquesConfig, TrainingConfig


def param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model, tcfg: TechniquesConfig, train: TrainingConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, train.weight_decay)
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    name = tcfg.optimizer
    if name == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=0.9)
    fused = name == "adamw-fused" or (name == "adamw" and on_cuda)
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), fused=fused or None,
                             foreach=None if fused else True)
