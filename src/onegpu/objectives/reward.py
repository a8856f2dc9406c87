"""Reward models: a one-output sequence-classification head on the model (models.load_model's
score_head) trained on preference pairs with the Bradley-Terry loss, as TRL's RewardTrainer.

Per pair, with r_c / r_r = the head's score of the whole chosen / rejected sequence (prompt and
response, its last token before padding), m = the pair's margin column (0 without one) and
c = preference.center_rewards_coefficient:
    loss = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2
TRL averages both terms over a batch's pairs; a micro-batch here returns their sum and the step
divides by the pairs of the whole accumulated batch. The chosen and rejected sequences of a
micro-batch run as one padded batch (data/pairs.PairCollator, chosen first), as TRL's collator
does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onegpu.data.pairs import MARGIN, PAIR_INDEX
from onegpu.objectives.base import Objective
from onegpu.objectives.preference import _moe_aux

STATS = ("pairs", "correct", "margin", "chosen", "rejected")  # sums kept for the log


def bradley_terry_loss(r_c, r_r, margin=None, center: float | None = None):
    """The per-pair loss (see the module's docstring)."""
    z = r_c - r_r if margin is None else r_c - r_r - margin
    loss = -F.logsigmoid(z)
    if center is not None:
        loss = loss + center * (r_c + r_r) ** 2
    return loss


def scores(model, batch: dict):
    """(model output, the head's score of each row in fp32: its one logit at the row's last real
    token)."""
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    )
    return out, out.logits.squeeze(-1).float()


class Reward(Objective):
    """training.objective reward: the summed per-pair loss of a pair batch, normalised by pairs;
    logs the accuracy (the share of pairs scored chosen above rejected), the margin and the mean
    scores, kept on the device until a log reads them, as Preference's."""

    def __init__(self, pref, tokens):
        self.tokens = tokens  # unused: the head is the model's own, not the LM head
        self.center = pref.center_rewards_coefficient
        self.pending: list[torch.Tensor] = []
        self.window: torch.Tensor | None = None

    def count(self, batch: dict) -> int:
        return batch[PAIR_INDEX].numel()

    def loss(self, model, batch: dict) -> torch.Tensor:
        out, r = scores(model, batch)
        n = r.numel() // 2
        r_c, r_r = r[:n], r[n:]
        loss = bradley_terry_loss(r_c, r_r, batch.get(MARGIN), self.center)
        rc, rr = r_c.detach(), r_r.detach()
        self.pending.append(
            torch.stack(
                [
                    rc.new_tensor(float(n)),
                    (rc > rr).sum().float(),
                    (rc - rr).sum(),
                    rc.sum(),
                    rr.sum(),
                ]
            )
        )
        return loss.sum() + _moe_aux(model, out, n)

    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        self.pending.clear()
        return micro

    def end_cycle(self) -> None:
        if self.pending:
            total = torch.stack(self.pending).sum(0)
            self.window = total if self.window is None else self.window + total
        self.pending.clear()

    def window_metrics(self) -> dict:
        window, self.window = self.window, None
        return _means(window)

    def begin_eval(self) -> None:
        self.pending.clear()

    def eval_metrics(self) -> dict:
        pending = torch.stack(self.pending).sum(0) if self.pending else None
        self.pending.clear()
        return _means(pending)


def _means(sums: torch.Tensor | None) -> dict:
    if sums is None:
        return {}
    s = dict(zip(STATS, sums.tolist(), strict=True))
    n = max(s["pairs"], 1.0)
    return {
        "reward_accuracy": s["correct"] / n,
        "reward_margin": s["margin"] / n,
        "reward_chosen": s["chosen"] / n,
        "reward_rejected": s["rejected"] / n,
    }
