"""A log's statistics summed on the device, the way every preference-style objective keeps them
(DPO/ORPO/SimPO, KTO, reward models): each call adds its sums as pending (no host sync); the cycle's
end commits them to the window (an out-of-memory retry drops the failed cycle's pending sums); a
log reads and resets the window; an evaluation reads its own pending sums."""

from __future__ import annotations

import torch

PAIR_STATS = ("pairs", "correct", "margin", "chosen", "rejected")  # a pair objective's sums


class SummedStats:
    def __init__(self):
        self.pending: list[torch.Tensor] = []
        self.window: torch.Tensor | None = None

    def add(self, sums: torch.Tensor) -> None:
        self.pending.append(sums)

    def drop(self) -> None:
        """Forget the pending sums (a cycle starts again, or an evaluation starts)."""
        self.pending.clear()

    def commit(self) -> None:
        if self.pending:
            total = torch.stack(self.pending).sum(0)
            self.window = total if self.window is None else self.window + total
        self.pending.clear()

    def take_window(self) -> torch.Tensor | None:
        window, self.window = self.window, None
        return window

    def take_pending(self) -> torch.Tensor | None:
        pending = torch.stack(self.pending).sum(0) if self.pending else None
        self.pending.clear()
        return pending


def pair_sums(rc: torch.Tensor, rr: torch.Tensor) -> torch.Tensor:
    """The PAIR_STATS sums of a batch's chosen and rejected rewards (detached)."""
    return torch.stack(
        [
            rc.new_tensor(float(rc.numel())),
            (rc > rr).sum().float(),
            (rc - rr).sum(),
            rc.sum(),
            rr.sum(),
        ]
    )


def pair_means(sums: torch.Tensor | None) -> dict:
    """Mean rewards, margin and accuracy over the pairs summed (one host sync)."""
    if sums is None:
        return {}
    s = dict(zip(PAIR_STATS, sums.tolist(), strict=True))
    n = max(s["pairs"], 1.0)
    return {
        "reward_accuracy": s["correct"] / n,
        "reward_margin": s["margin"] / n,
        "reward_chosen": s["chosen"] / n,
        "reward_rejected": s["rejected"] / n,
    }
