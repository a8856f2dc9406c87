"""Exact resume: 2N steps straight == N steps, stop, resume, N more (bitwise on CPU fp32).

Covers every optimizer family, a stop in the middle of an accumulation cycle, an out-of-memory
switch of the micro-batch before the checkpoint, and LoRA adapters.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from helpers import assert_same_weights, losses, make_cfg, straight_then_resumed
from onegpu import train
from onegpu.training import assemble

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


OPTIMIZERS = {  # name -> (class it builds, package it needs beyond torch)
    "adamw": ("AdamW", None),
    "sgd": ("SGD", None),
    "adafactor": ("Adafactor", None),
    "adamw-8bit": ("AdamW8bit", "bitsandbytes"),
    "paged-adamw-8bit": ("PagedAdamW8bit", "bitsandbytes"),
    "adamw-8bit-ao": ("AdamW8bit", "torchao"),
}


# torchao's 8-bit AdamW compiles its step: 25 CPU s from a cold cache, so in the slow tier
@pytest.mark.parametrize(
    "optimizer",
    [pytest.param(o, marks=[pytest.mark.slow] if o == "adamw-8bit-ao" else []) for o in OPTIMIZERS],
)
def test_resume_is_exact_for_each_optimizer(tmp_path, tiny_model_dir, tiny_tokenizer, optimizer):
    import importlib.util

    from helpers import make_tiny_llama
    from onegpu.config import TechniquesConfig, TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    cls, package = OPTIMIZERS[optimizer]
    if (
        package and importlib.util.find_spec(package) is None
    ):  # only a missing optional package skips
        pytest.skip(f"{package} is not installed")
    opt = build_optimizer(
        make_tiny_llama(tiny_tokenizer), TechniquesConfig(optimizer=optimizer), TrainingConfig()
    )
    assert type(opt).__name__ == cls
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, {"optimizer": optimizer})
    assert got == expected
    assert any(r[0] == "val" for r in got) and len([r for r in got if r[0] == "train"]) == 6
    assert_same_weights(a, b)


# 31.7 CPU s from a cold inductor cache (the compile's workers included): slow tier
@pytest.mark.slow
def test_a_compiled_run_resumes_exactly(tmp_path, tiny_model_dir):
    """Inductor-compiled blocks (as compile=auto gives a run of 50+ steps on a CPU with g++): the
    resumed half ends bitwise equal to the straight run. The random-kill test runs eagerly."""
    from onegpu.techniques.compile import has_cpu_compiler

    if not has_cpu_compiler():
        pytest.skip("no C++ compiler for inductor's CPU kernels")
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, {"compile": "default"})
    assert got == expected and len([r for r in got if r[0] == "train"]) == 6
    assert_same_weights(a, b)


def test_resume_latest_after_oom_switch_keeps_smaller_micro_batch(
    tmp_path, tiny_model_dir, monkeypatch
):
    """An OOM at step 2 halves the micro-batch; the checkpoint records it and resume keeps it."""
    from helpers import oom_above

    monkeypatch.setattr(assemble, "make_objective", oom_above(2, assemble.make_objective))
    expected, got, a, b = straight_then_resumed(
        tmp_path, tiny_model_dir, micro_batch_size=4, grad_accum=1
    )
    assert got == expected
    assert_same_weights(a, b)
    state = json.loads(
        (a.parent / "runs" / "run" / "checkpoint-00000003" / "state.json").read_text()
    )
    assert (state["micro_batch_size"], state["grad_accum"]) == (2, 2)


def test_stop_mid_accumulation_cycle_restarts_the_cycle(tmp_path, tiny_model_dir, monkeypatch):
    """SIGINT during micro-batch 2 of 3 in step 4: the partial cycle is dropped, the checkpoint is
    the state after step 3 (with the RNG of that moment), and the resumed run matches a straight
    run."""
    cfg = make_cfg(tmp_path, tiny_model_dir, name="straight", grad_accum=3, save_every=0)
    straight = train(cfg)
    calls = {"n": 0}
    real = assemble.make_objective

    def interrupting(*args):
        objective = real(*args)
        fn = objective.loss

        def loss(model, batch):
            calls["n"] += model.training
            if model.training and calls["n"] == 3 * 3 + 2:  # step 4, micro-batch 2
                os.kill(os.getpid(), signal.SIGINT)
            return fn(model, batch)

        objective.loss = loss
        return objective

    monkeypatch.setattr(assemble, "make_objective", interrupting)
    cfg2 = make_cfg(tmp_path, tiny_model_dir, name="stopped", grad_accum=3, save_every=0)
    stopped = train(cfg2)
    assert stopped.stopped == "SIGINT" and stopped.state.step == 3
    state = json.loads((stopped.run_dir / "checkpoint-00000003" / "state.json").read_text())
    assert state["batches_seen"] == 9  # three whole cycles: the interrupted one is redone
    monkeypatch.setattr(assemble, "make_objective", real)
    cfg2["output"]["resume"] = "latest"
    resumed = train(cfg2)
    assert losses(resumed.run_dir) == losses(straight.run_dir)
    assert_same_weights(straight.run_dir / "final", resumed.run_dir / "final")


def test_resume_with_lora(tmp_path, tiny_model_dir):
    pytest.importorskip("peft")
    expected, got, a, b = straight_then_resumed(
        tmp_path, tiny_model_dir, {"lora": {"enabled": True, "r": 4}}
    )
    assert got == expected
    assert (a / "adapter_model.safetensors").is_file()
    assert_same_weights(a, b)


def test_overwrite_discards_the_old_runs_checkpoints(tmp_path, tiny_model_dir):
    """Otherwise a later `resume latest` would continue the old run's newer checkpoint."""
    from onegpu.checkpoint import local as checkpoint

    train(make_cfg(tmp_path, tiny_model_dir, max_steps=4, save_every=2, eval_every=0))
    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=1, save_every=1, eval_every=0)
    cfg["output"]["overwrite"] = True
    r = train(cfg)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(r.run_dir)] == [1]
    assert max(x[1] for x in losses(r.run_dir)) == 1
