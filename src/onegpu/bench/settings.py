"""The settings of `onegpu bench train`: a run ``Config`` (the baseline arm) plus a ``bench``
section.

Kept apart from the sweep (train.py) and the arm table (arms.py) so that both can read the same
typed settings without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from onegpu.config import Config, DataConfig, ModelConfig, OutputConfig, TrainingConfig


@dataclass
class BenchSettings:
    """How the benchmark runs (the arms' run settings are the Config sections beside this one)."""

    warmup_steps: int = 2
    """Leading steps left out of the timing (allocator warm-up, compilation); also the logging
    interval."""
    max_seconds: float = 120.0
    """Time budget of one arm's training loop; an arm that runs out reports the steps it finished.
    """
    reps: int = 3
    """Repetitions of every arm, interleaved (A, B, C, A, B, C, ...)."""
    arms: str = "all"
    """Comma-separated arm names, or "all". The baseline arm is always included."""
    best: str = "auto"
    """Arms merged into the "best" arm (comma-separated), or "auto" for this device's recommended
    set."""
    max_micro_batch: int = 0
    """Largest micro-batch the batch-size arm may use (0: no limit). That arm puts the whole
    effective batch in one micro-batch; above this limit it uses the largest divisor of the
    effective batch that fits, so a sweep at a large model does not measure an out-of-memory retry
    instead."""
    out: str = "benchmarks/results"
    """Folder for the results (json, md, png)."""
    name: Optional[str] = None
    """File stem of the results (default: train-<device>-<date>)."""
    dry_run: bool = False
    """Check the settings and list the arms this device would run (and why others are skipped),
    without tokenizing or training anything."""


def _bench_model() -> ModelConfig:
    return ModelConfig(name="tiny", from_scratch=True)


def _bench_data() -> DataConfig:
    return DataConfig(seq_len=256, max_bytes=1_000_000, num_proc=1)


def _bench_training() -> TrainingConfig:
    # No learning-rate warm-up: HF's schedule starts warm-up at lr 0 and ours at lr/warmup; without
    # it both are the same cosine, so the final losses are comparable. No evaluation: not timed.
    return TrainingConfig(
        micro_batch_size=8, grad_accum=2, max_steps=10, warmup_steps=0, eval_every=0, eval_batches=1
    )


def _bench_output() -> OutputConfig:
    return OutputConfig(report_to="none")


@dataclass
class BenchTrainConfig(Config):
    """The baseline arm's run ``Config`` (every section and flag of `onegpu train`, with defaults
    for a quick sweep: the tiny preset, 8 x 2 sequences of 256 tokens, 10 steps) plus ``bench``.
    Each arm overrides a few of its keys; the effective batch is kept by every arm."""

    model: ModelConfig = field(default_factory=_bench_model)
    data: DataConfig = field(default_factory=_bench_data)
    training: TrainingConfig = field(default_factory=_bench_training)
    output: OutputConfig = field(default_factory=_bench_output)
    bench: BenchSettings = field(default_factory=BenchSettings)
