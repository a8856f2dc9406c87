"""Training runs with FP8 (emulated on this CPU): exact resume, ordinary checkpoints that load
anywhere, and the loss of a short run tracking the same run without FP8. The default job's
200-step comparison was measured once: benchmarks/results/fp8-cpu-*.md."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_weights, losses, make_cfg, straight_then_resumed, weights
from onegpu import train

pytestmark = pytest.mark.usefixtures("one_thread")

FP8 = {"fp8": "tensorwise", "fp8_emulate": True}


def test_resume_with_fp8_is_exact(tmp_path, tiny_model_dir):
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, FP8)
    assert got == expected and len([r for r in got if r[0] == "train"]) == 6
    assert_same_weights(a, b)


def test_fp8_checkpoints_are_ordinary_and_load_without_torchao(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=3, save_every=3)
    cfg["techniques"].update(FP8)
    run = train(cfg).run_dir
    saved = weights(run / "final")
    base = weights(tiny_model_dir)
    assert saved.keys() == base.keys()  # the same names: no float8 state, no extra tensors
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert not torch.equal(
        saved["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"]
    )
    loaded = AutoModelForCausalLM.from_pretrained(str(run / "final"))
    assert all(type(m).__module__.startswith(("torch", "transformers")) for m in loaded.modules())
    assert (run / "config.yaml").read_text().count("fp8: tensorwise") == 1


def test_a_short_fp8_run_tracks_the_same_run_without_fp8(tmp_path, tiny_model_dir):
    """12 steps, emulated FP8 against fp32: the validation losses stay within 2% of each other
    (measured 0.2%; the default job's 200 steps: benchmarks/results/fp8-cpu-20261128.md)."""
    runs = {}
    for name, tech in (("fp32", {}), ("fp8", FP8)):
        cfg = make_cfg(
            tmp_path, tiny_model_dir, name=name, max_steps=12, save_every=0, eval_every=6, lr=3e-3
        )
        cfg["techniques"].update(tech)
        runs[name] = [r for r in losses(train(cfg).run_dir) if r[0] == "val"]
    steps = [r[1] for r in runs["fp32"]]
    assert steps == [r[1] for r in runs["fp8"]] and steps[-1] == 12
    first, last = runs["fp32"][0][2], runs["fp32"][-1][2]
    assert last < first  # it learned something to track
    for (_, _, ref, _), (_, _, got, _) in zip(runs["fp32"], runs["fp8"], strict=True):
        assert got != ref and abs(got - ref) / ref < 0.02
