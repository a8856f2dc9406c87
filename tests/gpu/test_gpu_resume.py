"""Exact resume and recovery on a CUDA GPU: the fp16 grad scaler and the CUDA RNG streams travel in
the checkpoint, and an out-of-memory retry keeps the math. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_weights, losses, make_cfg, oom_above, straight_then_resumed
from onegpu.checkpoint import local as checkpoint
from onegpu.training import assemble

pytestmark = pytest.mark.gpu


def test_checkpoint_holds_cuda_rng_and_scaler(tmp_path, tiny_model_dir):
    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=3, save_every=3)
    cfg["techniques"]["precision"] = "fp16"
    from onegpu import train

    r = train(cfg)
    blob = checkpoint.load_trainer_state(r.run_dir / "checkpoint-00000003")
    assert "cuda" in blob["rng"] and blob["rng"]["cuda"][0].dtype == torch.uint8
    assert blob["scaler"] and blob["scaler"]["scale"] > 0


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_is_exact_on_cuda(tmp_path, tiny_model_dir, precision):
    """Deterministic kernels make the second half repeat bitwise, as on CPU: cuBLAS with a fixed
    workspace (CUBLAS_WORKSPACE_CONFIG, set before CUDA starts: tests/gpu/conftest.py) and eager
    attention, whose backward is deterministic where SDPA's memory-efficient backward is not."""
    import os

    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        expected, got, a, b = straight_then_resumed(
            tmp_path, tiny_model_dir, {"precision": precision, "attention": "eager"}
        )
    finally:
        torch.use_deterministic_algorithms(False)
    assert got == expected
    assert_same_weights(a, b)


def test_oom_retry_on_cuda_matches_smaller_micro_batch(tmp_path, tiny_model_dir, monkeypatch):
    from onegpu import train

    ref = train(
        make_cfg(
            tmp_path, tiny_model_dir, name="small", micro_batch_size=2, grad_accum=2, eval_every=0
        )
    )
    monkeypatch.setattr(assemble, "make_objective", oom_above(2, assemble.make_objective))
    got = train(
        make_cfg(
            tmp_path, tiny_model_dir, name="oom", micro_batch_size=4, grad_accum=1, eval_every=0
        )
    )
    train_only = lambda r: [x for x in losses(r.run_dir) if x[0] == "train"]  # noqa: E731
    assert train_only(got) == train_only(ref)
