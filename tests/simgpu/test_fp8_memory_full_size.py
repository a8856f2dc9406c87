"""FP8's memory at full size: the planner's peak with torchao's float8 layers against PyTorch's
MemTracker for one training step of the Llama-3.2-1B shape (bf16 autocast over fp32 weights,
nothing checkpointed: each float8 layer saves its fp32 weight instead of a 16-bit copy, 1.81 GiB
less than the same step without FP8). The 3B and 8B rows: benchmarks/simgpu_memory.py --fp8."""

from __future__ import annotations

import dataclasses

import pytest
from fp8_fullsize import CHEAP
from fullsize import TOLERANCE, Setup, row, tracked

pytestmark = [pytest.mark.simgpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _fresh_accelerator():
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_planner_fp8_peak_within_5_percent_of_tracked_and_below_bf16():
    r = row(CHEAP)
    assert r["flash_calls"] >= 2 * 16 and r["other_sdpa_calls"] == 0
    assert r["ratio"] == pytest.approx(1.0, abs=TOLERANCE), r
    c = CHEAP.candidate
    bf16 = dataclasses.replace(c, techniques=dataclasses.replace(c.techniques, fp8="off"))
    plain = tracked(Setup(CHEAP.model, bf16, CHEAP.seq))
    # the float8 layers really ran (their saving shows): 16 layers x 60.8M weights x 2 bytes
    saved = (plain["peak"] - r["tracked_gib"] * 2**30) / 2**30
    assert saved == pytest.approx(
        16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) * 2 / 2**30, rel=0.02
    )
