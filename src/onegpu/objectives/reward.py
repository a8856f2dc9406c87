"""Reward models: a one-output sequence-classification head on the model (models.load_model's
score_head) trained on preference pairs with the Bradley-Terry loss, as TRL's RewardTrainer.

Per pair, with r_c / r_r = the head's score of the whole chosen / rejected sequence (prompt and
response, its last token before padding), m = the pair's margin column (0 without one) and
c = preference.center_rewards_coefficient:
    loss = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2
TRL averages both terms over a batch's pairs; a micro-batch here returns their sum and the step
divides by the pairs of the whole accumulated batch. The chosen and rejected sequences of a
micro-batch run as one padded batch (data/pairs.PairCollator, chosen first), as TRL's collator
does; an eager CPU step leaves out the columns that are padding in every row (``trimmed``).
With techniques.shared_prompt, a pair's two responses run in one row after one copy of their
prompt instead (objectives/shared_prompt.py): the same scores from fewer tokens.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from onegpu.data.pairs import MARGIN, PAIR_INDEX
from onegpu.errors import ConfigError
from onegpu.objectives import shared_prompt
from onegpu.objectives.base import Objective
from onegpu.objectives.preference import moe_aux
from onegpu.objectives.summed import SummedStats, pair_means, pair_sums

log = logging.getLogger(__name__)


def bradley_terry_loss(r_c, r_r, margin=None, center: float | None = None):
    """The per-pair loss (see the module's docstring)."""
    z = r_c - r_r if margin is None else r_c - r_r - margin
    loss = -F.logsigmoid(z)
    if center is not None:
        loss = loss + center * (r_c + r_r) ** 2
    return loss


def scores(model, batch: dict, trim: bool = False):
    """(model output, the head's score of each row in fp32: its one logit at the row's last real
    token). ``trim``: leave out the columns past the longest row's end first (see ``trimmed``)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if trim:
        ids, mask = trimmed(ids, mask)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    return out, out.logits.squeeze(-1).float()


def trimmed(ids, mask):
    """The batch without the columns that are padding in every row. The collator rounds the width
    up to data.pad_to_multiple (64: fewer compiled shapes), which an eager CPU step computes for
    nothing; rows are right-padded and attention is causal, so no real token sees those columns
    and the head reads each row's last real token: the same scores and gradients, less work (TRL's
    collator pads to the longest row alone)."""
    width = int(mask.sum(1).max())
    return ids[:, :width], mask[:, :width]


class Reward(Objective):
    """training.objective reward: the summed per-pair loss of a pair batch, normalised by pairs;
    logs the accuracy (the share of pairs scored chosen above rejected), the margin and the mean
    scores, kept on the device until a log reads them, as Preference's."""

    def __init__(self, pref, tokens, trim: bool = False, shared: str = "off"):
        self.tokens = tokens  # unused: the head is the model's own, not the LM head
        self.center = pref.center_rewards_coefficient
        self.shared = shared  # techniques.shared_prompt
        self.takes_shared: bool | None = None  # the run's model takes the rows: check_model
        # make_objective: an eager run on a CPU. Compiled steps keep the bucketed widths (one
        # compiled shape per bucket), and on a GPU reading the longest row's length would make
        # the host wait for the previous step's kernels; on a CPU nothing runs ahead to wait for.
        self.trim = trim
        self.stats = SummedStats()

    def count(self, batch: dict) -> int:
        return batch[PAIR_INDEX].numel()

    def check_model(self, model) -> None:
        """Settle techniques.shared_prompt for the run's ``model`` (logged once): `on` where the
        model cannot take the shared rows is a ConfigError here, before the run writes anything."""
        if self.shared == "off" or self.takes_shared is not None:
            return
        why = shared_prompt.applies(model)
        if why is not None and self.shared == "on":
            raise ConfigError(
                f"techniques.shared_prompt=on, but {why}.",
                hint="set techniques.shared_prompt auto (on where it applies) or off",
            )
        log.info(
            "techniques.shared_prompt: %s",
            "on (one prompt per pair)" if why is None else f"off: {why}",
        )
        self.takes_shared = why is None

    def uses_shared(self, model, batch: dict) -> bool:
        """Whether this batch runs as shared-prompt rows: techniques.shared_prompt, the model's
        ability to take them (check_model, once) and the batch's layout."""
        if self.shared == "off" or shared_prompt.INDEX not in batch:
            return False
        self.check_model(model)
        return self.takes_shared

    def loss(self, model, batch: dict) -> torch.Tensor:
        if self.uses_shared(model, batch):
            out, both = None, shared_prompt.scores(model, batch, self.trim)
            r_c, r_r = both[:, 0], both[:, 1]
            n = r_c.numel()
        else:
            out, r = scores(model, batch, self.trim)
            n = r.numel() // 2
            r_c, r_r = r[:n], r[n:]
        loss = bradley_terry_loss(r_c, r_r, batch.get(MARGIN), self.center)
        rc, rr = r_c.detach(), r_r.detach()
        self.stats.add(pair_sums(rc, rr))
        return loss.sum() + (moe_aux(model, out, n) if out is not None else 0.0)

    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        self.stats.drop()
        return micro

    def end_cycle(self) -> None:
        self.stats.commit()

    def window_metrics(self) -> dict:
        return pair_means(self.stats.take_window())

    def begin_eval(self) -> None:
        self.stats.drop()

    def eval_metrics(self) -> dict:
        return pair_means(self.stats.take_pending())
