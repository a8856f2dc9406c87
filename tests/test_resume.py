"""Exact resume: 2N steps straight == N steps, stop, resume, N more (bitwise on CPU fp32).

Covers every optimizer family, a stop in the middle of an accumulation cycle, an out-of-memory
switch of the micro-batch before the checkpoint, and LoRA adapters.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from onegpu.training import assemble
from onegpu.report import read_metrics
from onegpu import train

from conftest import CORPUS


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest single-threaded, and a shared CPU makes 2 threads crawl."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def write_data(tmp_path, n: int = 60):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": CORPUS[i % len(CORPUS)] * 2}) + "\n" for i in range(n)))
    return path


def make_cfg(tmp_path, model_dir, name="run", **training):
    t = dict(micro_batch_size=2, grad_accum=2, max_steps=6, eval_every=3, eval_batches=2, log_every=1,
             warmup_steps=2, save_every=3, lr=1e-2, seed=7)
    t.update(training)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(tmp_path)
    return {"model": {"name": str(model_dir)},
            "data": {"path": str(data), "seq_len": 32, "num_proc": 1, "val_fraction": 0.1},
            "training": t, "techniques": {}, "output": {"dir": str(tmp_path / "runs"), "name": name,
                                                       "tensorboard": False, "keep_last": 10}}


def losses(run_dir) -> list[tuple]:
    """(split, step, loss) of every record: timing fields differ between runs, the math must not."""
    return [(r["split"], r["step"], r.get("loss"), r.get("skipped")) for r in read_metrics(run_dir / "metrics.jsonl")]


def weights(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def straight_then_resumed(tmp_path, model_dir, techniques=None, resume_at=3, **training):
    """Run 2N steps, then redo the second half from the N-step checkpoint in the same run dir."""
    cfg = make_cfg(tmp_path, model_dir, **training)
    cfg["techniques"].update(techniques or {})
    first = train(cfg)
    run = first.run_dir
    expected = losses(run)
    saved_final = tmp_path / "final-straight"
    shutil.copytree(run / "final", saved_final)
    cfg["output"]["resume"] = str(run / f"checkpoint-{resume_at:08d}")
    second = train(cfg)
    assert second.state.step == cfg["training"]["max_steps"]
    return expected, losses(run), saved_final, run / "final"


OPTIMIZERS = {  # name -> (class it builds, package it needs beyond torch)
    "adamw": ("AdamW", None), "sgd": ("SGD", None), "adafactor": ("Adafactor", None),
    "adamw-8bit": ("AdamW8bit", "bitsandbytes"), "paged-adamw-8bit": ("PagedAdamW8bit", "bitsandbytes"),
    "adamw-8bit-ao": ("AdamW8bit", "torchao"),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resume_is_exact_for_each_optimizer(tmp_path, tiny_model_dir, tiny_tokenizer, optimizer):
    import importlib.util

    from conftest import make_tiny_llama
    from onegpu.config import TechniquesConfig, TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    cls, package = OPTIMIZERS[optimizer]
    if package and importlib.util.find_spec(package) is None:  # only a missing optional package skips
        pytest.skip(f"{package} is not installed")
    opt = build_optimizer(make_tiny_llama(tiny_tokenizer), TechniquesConfig(optimizer=optimizer), TrainingConfig())
    assert type(opt).__name__ == cls
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, {"optimizer": optimizer})
    assert got == expected
    assert any(r[0] == "val" for r in got) and len([r for r in got if r[0] == "train"]) == 6
    assert_same_weights(a, b)


def test_resume_latest_after_oom_switch_keeps_smaller_micro_batch(tmp_path, tiny_model_dir, monkeypatch):
    """An OOM at step 2 halves the micro-batch; the checkpoint records it and resume keeps it."""
    from test_recovery import oom_above

    monkeypatch.setattr(assemble, "make_objective", oom_above(2, assemble.make_objective))
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, micro_batch_size=4, grad_accum=1)
    assert got == expected
    assert_same_weights(a, b)
    state = json.loads((a.parent / "runs" / "run" / "checkpoint-00000003" / "state.json").read_text())
    assert (state["micro_batch_size"], state["grad_accum"]) == (2, 2)


def test_stop_mid_accumulation_cycle_restarts_the_cycle(tmp_path, tiny_model_dir, monkeypatch):
    """SIGINT during micro-batch 2 of 3 in step 4: the partial cycle is dropped, the checkpoint is
    the state after step 3 (with the RNG of that moment), and the resumed run matches a straight run."""
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
    expected, got, a, b = straight_then_resumed(tmp_path, tiny_model_dir, {"lora": {"enabled": True, "r": 4}})
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
