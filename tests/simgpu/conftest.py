"""The simulated-GPU tier (marker ``simgpu``): see cards.py for what a card is and substitutes.

In the test run itself this builds the shim once and starts one process per card (test_cards.py);
inside a card's process (``ONEGPU_SIMGPU_CARD`` set) it installs the card before any test runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import cards
import pytest

if os.environ.get(cards.ENV_CARD):
    cards.install(cards.current())


def _cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "onegpu-simgpu"


@pytest.fixture(scope="session")
def shim() -> Path:
    """The built shim (tests/simgpu/shim.cpp); skips with the reason where it cannot be built."""
    path, why = cards.build_shim(_cache())
    if path is None:
        pytest.skip(f"simulated GPU unavailable: {why}")
    return path


@pytest.fixture
def card() -> cards.Card:
    """The card this process simulates."""
    return cards.current()


@pytest.fixture
def fake_cuda():
    """Fake "cuda" tensors for the test (cards.fake_cuda)."""
    with cards.fake_cuda() as mode:
        yield mode
