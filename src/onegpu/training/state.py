"""What a run carries between steps (checkpointed), what it returns, and the hooks that observe
it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onegpu.data.overlong import DataStats


@dataclass
class TrainState:
    step: int = 0
    batches_seen: int = (
        0  # micro-batches (of micro_batch_size) of completed steps: the data position
    )
    tokens_seen: int = 0  # real (non-padding) input tokens
    best_eval: float = math.inf
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    micro_batch_size: int = 0  # current sizes: an out-of-memory retry changes them mid-run
    grad_accum: int = 0
    skipped_steps: int = 0  # updates skipped for a non-finite loss/gradient
    bad_streak: int = 0
    stopped: str | None = None  # the signal that stopped the run early, if any
    rng: Any = field(
        default=None, repr=False
    )  # RNG states restored from a checkpoint, applied by fit()
    # This process's training speed: the logged windows together (evaluation and saving left out).
    # Not checkpointed: a resumed run reports its own speed.
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    # Where this process started (a resumed run: the checkpoint's step and tokens). Not
    # checkpointed: the summary counts what this process trained, not what earlier ones did.
    start_step: int = 0
    start_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.timed_tokens / max(self.timed_seconds, 1e-9)

    @property
    def trained_steps(self) -> int:
        """Optimizer steps this process ran."""
        return self.step - self.start_step

    @property
    def trained_tokens(self) -> int:
        """Real input tokens this process trained on."""
        return self.tokens_seen - self.start_tokens

    @property
    def first_eval(self) -> float | None:
        """The first validation loss of the run (step 0: the untrained baseline), if any."""
        return self.history[0][1] if self.history else None

    @property
    def last_eval(self) -> float | None:
        return self.history[-1][1] if self.history else None

    def to_dict(self) -> dict:
        last = self.history[-1] if self.history else None
        return {
            "step": self.step,
            "batches_seen": self.batches_seen,
            "tokens_seen": self.tokens_seen,
            "best_eval": self.best_eval,
            "history": self.history,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "skipped_steps": self.skipped_steps,
            "bad_streak": self.bad_streak,
            "eval_loss": last[1] if last and last[0] == self.step else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        """The state a checkpoint recorded; this process starts counting from it."""
        return cls(
            step=d["step"],
            batches_seen=d["batches_seen"],
            tokens_seen=d["tokens_seen"],
            best_eval=d["best_eval"],
            history=[(int(s), float(v)) for s, v in d["history"]],
            micro_batch_size=d.get("micro_batch_size", 0),
            grad_accum=d.get("grad_accum", 0),
            skipped_steps=d.get("skipped_steps", 0),
            bad_streak=d.get("bad_streak", 0),
            start_step=d["step"],
            start_tokens=d["tokens_seen"],
        )


@dataclass
class RunResult:
    run_dir: Path
    final_dir: Path
    state: TrainState
    first_eval: float | None
    last_eval: float | None
    wall_seconds: float
    tokens_per_second: float
    stopped: str | None = (
        None  # set when a signal ended the run early; final_dir is then its checkpoint
    )
    data_stats: list[DataStats] = field(
        default_factory=list
    )  # per split: over-long records and their fate
    sample_prompt: str | None = None  # a prompt from the data, for the end-of-run generate hint


class Callback:
    """Hooks into the loop, for code that observes a run without changing it (the benchmark child,
    a notebook). Override what you need; every process calls them."""

    def on_reference_pass(self, seconds: float) -> None:
        """DPO's precomputed reference pass took ``seconds`` (before the loop, before
        on_train_begin)."""

    def on_train_begin(self, run, state: TrainState) -> None:
        """Model, optimizer and data are built and prepared; the first step is next."""

    def on_step_end(self, run, state: TrainState) -> None:
        """An optimizer step finished (state.step counts it); nothing was synchronised for it."""

    def on_log(self, run, state: TrainState, record: dict) -> None:
        """A training log record was written (every training.log_every steps)."""

    def on_train_end(self, run, state: TrainState) -> None:
        """The loop returned; the final model is not saved yet."""
