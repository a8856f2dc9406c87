"""The Objective protocol: what a run optimises, as the step, the loop and evaluation see it.

An objective is built once per run with everything it needs (its reference included: no attribute is
set on it afterwards) and is then called only through these methods:

- ``count(batch)``: what one micro-batch's summed loss is normalised by (target tokens for SFT,
  pairs for the preference objectives); the step divides by the sum over the whole accumulated
  batch;
- ``loss(model, batch)``: the micro-batch's *summed* loss;
- ``begin_cycle(model, micro)`` / ``end_cycle()``: an accumulation cycle's start and end. The cycle
  trains on the micro-batches ``begin_cycle`` returns: the data's own for SFT and the preference
  objectives; an objective that makes its own batches (GRPO: rollouts of the cycle's prompts,
  generated and scored by the model) returns those instead, and ``count`` then counts their tokens.
  Statistics a cycle gathers become the window's only at ``end_cycle``, so a cycle redone after an
  out-of-memory error is not counted twice;
- ``window_metrics()``: the objective's own figures for a logging window (reward accuracy and margin
  for the preference objectives, a rollout's reward for GRPO; nothing for SFT), reset when read;
- ``begin_eval()`` / ``eval_metrics()``: the same figures over an evaluation pass, kept apart from
  training's window;
- ``needs_reference``: what it needs from a reference: None, "adapters" (the policy with its
  adapters off), "copy" (a frozen copy), "fixed" (a planner probe's stand-in) or "precomputed" (the
  batches must carry reference log-probs: the run computes them before the first step);
  ``reference_name`` names the reference object it was given, for reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onegpu.objectives.tokens import TokenLoss


class Objective(ABC):
    """Base of every objective; the defaults are those of an objective without statistics (SFT)."""

    tokens: TokenLoss  # the output head's loss it computes through (fused or plain; tokens.py)

    @abstractmethod
    def count(self, batch: dict) -> int:
        """The normaliser of this micro-batch (``with_target_positions`` has been applied)."""

    @abstractmethod
    def loss(self, model, batch: dict):
        """The summed loss of one micro-batch (a scalar tensor)."""

    def check_model(self, model) -> None:  # noqa: B027 (optional hook: most need nothing more)
        """The prepared model, before anything is written: raise ConfigError for what this
        objective's settings need of it and it lacks."""

    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        """Start an accumulation cycle; returns the micro-batches it trains on."""
        return micro

    def end_cycle(self) -> None:  # noqa: B027 (optional hook: most objectives keep no statistics)
        """The cycle completed (its update was made or skipped): commit its statistics."""

    def window_metrics(self) -> dict[str, float]:
        """Figures since the last call, for the training log (one host sync at most)."""
        return {}

    def begin_eval(self) -> None:  # noqa: B027 (optional hook, as end_cycle)
        """An evaluation pass begins: statistics from here on are the evaluation's."""

    def eval_batch_size(self, micro_batch_size: int) -> int:
        """Validation examples per evaluation batch (GRPO: prompts, each sampled group_size
        times)."""
        return micro_batch_size

    def eval_micro(self, model, batch: dict) -> list[dict]:
        """The batches an evaluation batch is scored as (GRPO: its prompts' rollouts)."""
        return [batch]

    def eval_metrics(self) -> dict[str, float]:
        """The evaluation pass's figures (dropped once read)."""
        return {}

    @property
    def needs_reference(self) -> str | None:
        """None, "adapters", "copy", "fixed" or "precomputed" (see the module's docstring)."""
        return None

    @property
    def reference_name(self) -> str | None:
        """The reference this objective computes against, for reports; None without one."""
        return None
