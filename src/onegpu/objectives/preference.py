"""Preference tuning: DPO, ORPO and SimPO as losses over the log-probs of chosen and rejected
responses.

One forward serves a whole pair batch (data/pairs.py puts the chosen and the rejected sequences in
one batch), with the fused head computing per-token log-probs chunk by chunk (fused_loss.py), and
the step, accumulation, checkpointing, compile, precision, optimizers and adapters are SFT's own.
A micro-batch returns its *summed* per-pair loss; the step divides by the pairs of the whole
accumulated batch, so the gradient equals one big batch's however the pairs fall.

The formulas, per pair, with pi = a response's summed log-prob under the policy, ref = under the
reference, |y| = its tokens, s(x) = log sigmoid(x), eps = label smoothing:
- DPO (Rafailov et al. 2023, eq. 7; eps: Mitchell 2023): z = beta((pi_c - ref_c) - (pi_r - ref_r)),
  loss = -(1 - eps) s(z) - eps s(-z); rewards beta(pi - ref).
- SimPO (Meng et al. 2024, eq. 6): z = beta(pi_c/|y_c| - pi_r/|y_r|) - gamma, gamma = ratio x beta;
  loss as DPO's; rewards beta pi/|y|.
- ORPO (Hong et al. 2024, eqs. 6-7): a = pi/|y| (mean token log-prob);
  log odds(y) = a - log(1 - e^a); loss = -a_c + lambda (-s(log odds_c - log odds_r)),
  lambda = beta; rewards beta a. The SFT term is per pair (mean over its tokens), as in the paper;
  TRL's ORPOTrainer averages it over the batch's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onegpu.data.pairs import PAIR_INDEX, REF_LOGPS, SEQUENCE_IDS
from onegpu.data.unpaired import EXAMPLE_INDEX
from onegpu.objectives.base import Objective
from onegpu.objectives.summed import SummedStats, pair_means, pair_sums
from onegpu.objectives.tokens import TARGETS, TokenLoss

AUTO_BETA = {
    "dpo": 0.1,
    "orpo": 0.1,
    "simpo": 2.0,
    "kto": 0.1,
}  # sources: config.PreferenceConfig.beta


def resolve_beta(objective: str, beta) -> float:
    return AUTO_BETA[objective] if beta == "auto" else float(beta)


# ------------------------------------------------------------------------------------- formulas
def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float, smoothing: float = 0.0):
    """(loss, chosen reward, rejected reward) per pair."""
    rc, rr = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    z = rc - rr
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z), rc, rr


def simpo_loss(pi_c, pi_r, len_c, len_r, beta: float, gamma_ratio: float, smoothing: float = 0.0):
    rc, rr = beta * pi_c / len_c, beta * pi_r / len_r
    z = rc - rr - gamma_ratio * beta
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z), rc, rr


def orpo_loss(pi_c, pi_r, len_c, len_r, lam: float):
    a_c, a_r = pi_c / len_c, pi_r / len_r
    # log(1 - e^a) for a < 0, computed stably; a mean log-prob is never above 0
    log_odds = (a_c - a_r) - (
        torch.log1p(-torch.exp(a_c).clamp(max=1 - 1e-7))
        - torch.log1p(-torch.exp(a_r).clamp(max=1 - 1e-7))
    )
    return -a_c - lam * F.logsigmoid(log_odds), lam * a_c, lam * a_r


# ------------------------------------------------------------------------------- log-probs per
# sequence
def sequence_logps(model, batch: dict, tokens: TokenLoss | int = 0):
    """(model output, summed response log-prob per sequence, response tokens per sequence): 2n
    values for a pair batch, chosen first; n for a batch of n examples (KTO's, data/unpaired.py).
    The target of position p is token p + 1, so it belongs to token p + 1's
    sequence. ``tokens``: the objective's TokenLoss (an int: a fused chunk size without fallback,
    0 = plain)."""
    tokens = tokens if isinstance(tokens, TokenLoss) else TokenLoss(tokens)
    out, logps = tokens.token_logps(model, batch)
    positions = batch[TARGETS]
    seq = batch[SEQUENCE_IDS].reshape(-1).index_select(0, positions + 1)
    n_seq = 2 * batch[PAIR_INDEX].numel() if PAIR_INDEX in batch else batch[EXAMPLE_INDEX].numel()
    sums = logps.new_zeros(n_seq).index_add(0, seq, logps)
    lengths = logps.new_zeros(n_seq).index_add_(0, seq, torch.ones_like(logps)).clamp_(min=1)
    return out, sums, lengths


class Preference(Objective):
    """training.objective dpo / orpo / simpo: the summed per-pair loss of a pair batch, normalised
    by pairs.

    The reward statistics of each call are kept on the device (no sync) as pending sums;
    ``end_cycle`` commits them to the window (an out-of-memory retry drops the failed cycle's),
    ``window_metrics`` reads and resets the committed ones; an evaluation reads its own pending
    sums (``eval_metrics``).
    ``reference`` (DPO): ``(model, batch) -> reference log-probs`` (reference.py), or None when the
    batches carry them (precomputed).
    """

    def __init__(self, objective: str, pref, tokens: TokenLoss, reference=None):
        self.objective, self.tokens = objective, tokens
        self.beta = resolve_beta(objective, pref.beta)
        self.smoothing, self.gamma_ratio = pref.label_smoothing, pref.simpo_gamma_ratio
        self.reference = reference
        self.stats = SummedStats()

    def count(self, batch: dict) -> int:
        return batch[PAIR_INDEX].numel()

    def loss(self, model, batch: dict) -> torch.Tensor:
        ref = None
        if (
            self.objective == "dpo"
        ):  # first: its no-grad forward is over before the policy's activations exist
            ref = batch[REF_LOGPS] if REF_LOGPS in batch else self._reference(model, batch)
        out, pi, lengths = sequence_logps(model, batch, self.tokens)
        n = pi.numel() // 2
        pi_c, pi_r, len_c, len_r = pi[:n], pi[n:], lengths[:n], lengths[n:]
        if self.objective == "dpo":
            loss, rc, rr = dpo_loss(pi_c, pi_r, ref[:n], ref[n:], self.beta, self.smoothing)
        elif self.objective == "simpo":
            loss, rc, rr = simpo_loss(
                pi_c, pi_r, len_c, len_r, self.beta, self.gamma_ratio, self.smoothing
            )
        else:
            loss, rc, rr = orpo_loss(pi_c, pi_r, len_c, len_r, self.beta)
        rc, rr = rc.detach(), rr.detach()
        self.stats.add(pair_sums(rc, rr))
        return loss.sum() + moe_aux(model, out, n)

    def _reference(self, model, batch):
        if self.reference is None:
            raise RuntimeError(
                "DPO needs reference log-probs: none in the batch and no reference given "
                "(objectives.make_objective builds one)"
            )
        return self.reference(model, batch)

    @property
    def needs_reference(self) -> str | None:
        if self.reference is not None:
            return self.reference.kind
        return "precomputed" if self.objective == "dpo" else None

    @property
    def reference_name(self) -> str | None:
        if self.reference is not None:
            return type(self.reference).__name__
        return "precomputed" if self.objective == "dpo" else None

    # the statistics: pending (this cycle) -> window (since the last log)
    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        self.stats.drop()
        return micro

    def end_cycle(self) -> None:
        self.stats.commit()

    def window_metrics(self) -> dict:
        """Mean rewards, margin and accuracy over the pairs since the last call (one host sync)."""
        return pair_means(self.stats.take_window())

    def begin_eval(self) -> None:
        self.stats.drop()

    def eval_metrics(self) -> dict:
        """The same means over the evaluation's calls, which are dropped."""
        return pair_means(self.stats.take_pending())


def moe_aux(model, out, pairs: int):
    """The MoE router loss weighted by the micro-batch's pairs: after the step divides by all pairs,
    the step adds coef x (pair-weighted mean aux loss), as moe_aux_term does per token for SFT."""
    aux = getattr(out, "aux_loss", None)
    if aux is None or not model.training:
        return 0.0
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) * aux.float() * pairs


def disable_dropout(model) -> int:
    """Dropout off everywhere (as TRL's DPOTrainer does by default): with it, the policy's and the
    reference's log-probs of the same text differ at step 0 and the reward margin starts as noise.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, n = 0.0, n + 1
    return n
