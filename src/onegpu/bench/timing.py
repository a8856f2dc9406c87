"""Timing figures the bench's loops share (our loop's log windows, the peers' clock marks)."""

from __future__ import annotations


def startup_seconds(
    early_seconds: float, early_steps: int, timed_seconds: float, timed_steps: int
) -> float | None:
    """What the untimed first steps took beyond the same steps at the timed (steady) rate: the
    one-off cost of compiling and warming up, reported beside tokens/s instead of hidden in it."""
    if not timed_steps or not early_steps:
        return None
    return max(0.0, early_seconds - early_steps * timed_seconds / timed_steps)
