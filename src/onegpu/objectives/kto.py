"""KTO (Ethayarajh et al. 2024, eq. 7; TRL's KTOTrainer, loss_type "kto"): unpaired thumbs-up /
thumbs-down data, each completion desirable or undesirable on its own.

Per example, with pi / ref = the completion's summed log-prob under the policy / the reference and
r = pi - ref:
- z0 = the KL estimate of the micro-batch: mean over its examples of (pi - ref) of the *mismatched*
  sequences (prompt i with completion i - 1, data/unpaired.py), no gradient, clamped at 0;
- desirable: loss = w_d (1 - sigmoid(beta (r - z0))); undesirable: w_u (1 - sigmoid(beta (z0 - r)));
  rewards beta r.
TRL averages the losses over a batch's examples; a micro-batch here returns their sum and the step
divides by the examples of the whole accumulated batch: the same gradient when micro-batches are
of one size, as TRL's accumulation assumes.

The mismatched sequences run in their own no-grad forward (as TRL's), so they cost no backward and
keep no activations. The reference is DPO's (reference.py): the policy with its adapters off under
LoRA, precomputed log-probs (of both the examples and their mismatched sequences) otherwise.
"""

from __future__ import annotations

import torch

from onegpu.data.pairs import REF_LOGPS
from onegpu.data.unpaired import EXAMPLE_INDEX, LABEL, mismatched
from onegpu.objectives.base import Objective
from onegpu.objectives.preference import moe_aux, resolve_beta, sequence_logps
from onegpu.objectives.summed import SummedStats
from onegpu.objectives.tokens import TokenLoss

# sums kept for the log: examples of each label, their rewards, the examples on their label's side
# of the reference point, the KL estimates and how many there were
STATS = ("desirable", "undesirable", "reward_d", "reward_u", "correct", "kl", "batches")


def kto_loss(pi, ref, kl, label, beta: float, desirable_weight: float, undesirable_weight: float):
    """(loss, reward) per example; ``kl``: the micro-batch's estimate (a scalar, no gradient);
    ``label``: True for desirable."""
    r = pi - ref
    z = torch.where(label, r - kl, kl - r)
    weight = torch.where(label, desirable_weight, undesirable_weight).to(pi.dtype)
    return weight * (1 - torch.sigmoid(beta * z)), beta * r.detach()


def kl_estimate(pi_kl, ref_kl):
    """TRL's z0: the mean log-ratio of the mismatched sequences, detached, at least 0."""
    return (pi_kl - ref_kl).mean().detach().clamp(min=0)


class KTO(Objective):
    """training.objective kto: the summed per-example loss of a batch, normalised by examples.

    ``reference``: ``(model, batch) -> 2n reference log-probs`` (the examples', then the mismatched
    sequences'; reference.batch_logps), or None when the batches carry them (precomputed).
    Statistics are kept on the device as pending sums, committed at ``end_cycle``, as Preference's.
    """

    def __init__(self, pref, tokens: TokenLoss, reference=None):
        self.tokens, self.reference = tokens, reference
        self.beta = resolve_beta("kto", pref.beta)
        self.weights = (pref.desirable_weight, pref.undesirable_weight)
        self.stats = SummedStats()

    def count(self, batch: dict) -> int:
        return batch[EXAMPLE_INDEX].numel()

    def loss(self, model, batch: dict) -> torch.Tensor:
        # no-grad forwards first: they are over before the policy's activations exist
        ref = batch[REF_LOGPS] if REF_LOGPS in batch else self._reference(model, batch)
        n = batch[EXAMPLE_INDEX].numel()
        with torch.no_grad():
            pi_kl = sequence_logps(model, mismatched(batch), self.tokens)[1]
        kl = kl_estimate(pi_kl, ref[n:])
        out, pi, _ = sequence_logps(model, batch, self.tokens)
        label = batch[LABEL].bool()
        loss, reward = kto_loss(pi, ref[:n], kl, label, self.beta, *self.weights)
        correct = torch.where(label, reward > self.beta * kl, reward < self.beta * kl)
        self.stats.add(
            torch.stack(
                [
                    label.sum().float(),
                    (~label).sum().float(),
                    reward[label].sum(),
                    reward[~label].sum(),
                    correct.sum().float(),
                    kl.float(),
                    kl.new_tensor(1.0),
                ]
            )
        )
        return loss.sum() + moe_aux(model, out, n)

    def _reference(self, model, batch):
        if self.reference is None:
            raise RuntimeError(
                "KTO needs reference log-probs: none in the batch and no reference given "
                "(objectives.make_objective builds one)"
            )
        return self.reference(model, batch)

    @property
    def needs_reference(self) -> str:
        return self.reference.kind if self.reference is not None else "precomputed"

    @property
    def reference_name(self) -> str:
        return type(self.reference).__name__ if self.reference is not None else "precomputed"

    # the statistics: pending (this cycle) -> window (since the last log)
    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        self.stats.drop()
        return micro

    def end_cycle(self) -> None:
        self.stats.commit()

    def window_metrics(self) -> dict:
        return _means(self.stats.take_window())

    def begin_eval(self) -> None:
        self.stats.drop()

    def eval_metrics(self) -> dict:
        return _means(self.stats.take_pending())


def _means(sums: torch.Tensor | None) -> dict:
    """Mean rewards of each label, their margin (as TRL's rewards/margins), the share of examples on
    their label's side of the reference point (each one's loss below half its weight) and the mean
    KL estimate; one host sync."""
    if sums is None:
        return {}
    s = dict(zip(STATS, sums.tolist(), strict=True))
    d, u = s["reward_d"] / max(s["desirable"], 1.0), s["reward_u"] / max(s["undesirable"], 1.0)
    both = s["desirable"] and s["undesirable"]
    out = {
        "reward_accuracy": s["correct"] / max(s["desirable"] + s["undesirable"], 1.0),
        "reward_margin": d - u if both else float("nan"),  # undefined without both labels
        "kl": s["kl"] / max(s["batches"], 1.0),
    }
    if s["desirable"]:
        out["reward_desirable"] = d
    if s["undesirable"]:
        out["reward_undesirable"] = u
    return out
