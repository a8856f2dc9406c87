"""Where onegpu keeps what it can rebuild: trained tokenizers, measured activation fits, the
CPU's measured speed, the planner's calibration. ``ONEGPU_CACHE`` moves it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("ONEGPU_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "onegpu"
    )
    return Path(root)
