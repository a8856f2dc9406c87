"""The planner's peak memory against PyTorch's MemTracker at full model size (Llama-3.2-1B, all
16 layers, real batch and length), for one training step through onegpu's own prepare_model, loss
and train_step on fake tensors, with attention routed to the card's FlashAttention kernel.
The harness and what it substitutes: tests/simgpu/fullsize.py; every row:
benchmarks/simgpu_memory.py."""

from __future__ import annotations

import pytest
from fullsize import CHEAP, TOLERANCE, Tracker, row

pytestmark = pytest.mark.simgpu


@pytest.fixture(autouse=True)
def _fresh_accelerator():
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
@pytest.mark.parametrize("setup", CHEAP, ids=lambda s: s.candidate.label())
def test_planner_peak_within_5_percent_of_tracked_peak(setup):
    r = row(setup)
    # The step ran the card's FlashAttention kernel (two steps, every layer), nothing else.
    assert r["flash_calls"] >= 2 * 16 and r["other_sdpa_calls"] == 0
    parts = r["tracked_parts_gib"]
    assert parts["param"] > 1.0 and parts["act"] > 0.5  # a full-size model and batch were tracked
    assert r["ratio"] == pytest.approx(1.0, abs=TOLERANCE), (
        f"{r['setup']}: predicted {r['predicted_gib']:.2f} GiB, tracked {r['tracked_gib']:.2f} "
        f"GiB; parts tracked {parts}, predicted {r['predicted_parts_gib']}"
    )


def test_the_trackers_peak_is_memtrackers():
    """The harness's tracker keeps the step's peak only: the same peak and parts as MemTracker."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(tracker_cls):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters())

        def step():
            model(torch.randn(64, 256)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # the optimizer's state exists, as in the harness's tracked step
        tracker = tracker_cls(model) if tracker_cls is Tracker else tracker_cls()
        tracker.track_external(model, optimizer)
        with tracker:
            step()
        (snap,) = tracker.get_tracker_snapshot("peak").values()
        return {str(k): v for k, v in snap.items()}

    ours, theirs = peak(Tracker), peak(MemTracker)
    assert ours == theirs and ours["Total"] > 4 * 256 * 256 * 4
