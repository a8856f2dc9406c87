"""The simulated-GPU tier: each card's checks (card_*.py) run in one process that sees that card."""

from __future__ import annotations

import cards
import pytest

pytestmark = pytest.mark.simgpu

# Each card's checks in two processes (the training step; offload, planning, refusals and the
# engine), so that each test of a fast card stays well under the fast tier's CPU limit on a fresh
# machine, where every compile is a cold one.
CHECKS = {
    "training": [
        "tests/simgpu/card_decisions.py",
        "tests/simgpu/card_step.py",
        "tests/simgpu/card_risks.py",
    ],
    "plan-engine": [
        "tests/simgpu/card_offload.py",
        "tests/simgpu/card_fit.py",
        "tests/simgpu/card_refusals.py",
        "tests/simgpu/card_plan_moe.py",
        "tests/simgpu/card_engine.py",
        "tests/simgpu/card_fp8.py",
    ],
}


# The H100 runs the training loop and the engine, the T4 the refusals: a minute each, so they are in
# the slow tier. The RTX 4090 (FP8's kernels) cost 24.5 CPU seconds on CI's machine as one
# process: slow as well. The A100's training step compiles from a cold cache in a process of its
# own (16 CPU seconds here, too near the limit for a slower machine): slow; its planning, refusals
# and engine checks stay in the fast tier.
SLOW_CARDS = {"H100", "T4", "RTX4090"}
SLOW_GROUPS = {("A100", "training")}


@pytest.mark.parametrize(
    "card, group",
    [
        pytest.param(
            c, g, marks=[pytest.mark.slow] if c in SLOW_CARDS or (c, g) in SLOW_GROUPS else []
        )
        for c in cards.CARDS
        for g in CHECKS
    ],
)
def test_card(card, group, shim):
    """A card's decisions, the training step and (H100) the loop, the planner's fit, its refusals
    and the engine, on a simulated card."""
    done = cards.run_card(card, shim, CHECKS[group])
    assert done.returncode == 0, f"{card} {group}:\n{done.stdout[-8000:]}\n{done.stderr[-3000:]}"
