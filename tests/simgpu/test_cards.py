"""The simulated-GPU tier: each card's checks (card_*.py) run in one process that sees that card."""

from __future__ import annotations

import cards
import pytest

pytestmark = pytest.mark.simgpu

CHECKS = [
    "tests/simgpu/card_decisions.py",
    "tests/simgpu/card_step.py",
    "tests/simgpu/card_risks.py",
    "tests/simgpu/card_fit.py",
    "tests/simgpu/card_refusals.py",
    "tests/simgpu/card_offload.py",
    "tests/simgpu/card_plan_moe.py",
    "tests/simgpu/card_engine.py",
    "tests/simgpu/card_fp8.py",
]


# The H100 runs the training loop and the engine, the T4 the refusals: a minute each, so they are in
# the slow tier. The RTX 4090 (FP8's kernels) costs 14 CPU seconds here and 24.5 on CI's machine,
# over the fast tier's limit there: slow as well. The A100 runs every check in the fast tier.
SLOW_CARDS = {"H100", "T4", "RTX4090"}


@pytest.mark.parametrize(
    "card",
    [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_CARDS else []) for c in cards.CARDS],
)
def test_card(card, shim):
    """Every card-dependent decision, the training step and (H100) the loop, on a simulated card."""
    done = cards.run_card(card, shim, CHECKS)
    assert done.returncode == 0, f"{card}:\n{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
