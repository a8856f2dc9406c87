"""Figures the bench's loops and reports share: the start-up cost (our loop's log windows, the
peers' clock marks), medians and ranges over rounds, a figure or a dash."""

from __future__ import annotations

import statistics


def startup_seconds(
    early_seconds: float, early_steps: int, timed_seconds: float, timed_steps: int
) -> float | None:
    """What the untimed first steps took beyond the same steps at the timed (steady) rate: the
    one-off cost of compiling and warming up, reported beside tokens/s instead of hidden in it."""
    if not timed_steps or not early_steps:
        return None
    return max(0.0, early_seconds - early_steps * timed_seconds / timed_steps)


def median(values) -> float | None:
    """The median of the values that are there (None: none are)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def span(values) -> list | None:
    """[min, max] of the values that are there (None: none are)."""
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def fmt(v, spec: str, suffix: str = "") -> str:
    """``v`` formatted, or a dash for a figure that is missing."""
    return "—" if v is None else f"{v:{spec}}{suffix}"
