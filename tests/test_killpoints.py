"""kill -9 at many moments, during training and inside checkpoint writes: the newest complete
checkpoint always loads and resumes, a half-written one is never picked, and the run that was
killed and resumed again and again ends bitwise equal to one that was never interrupted.

Processes are forked from a forkserver that imported torch once, so each restart costs the run's
own setup (about a second or two), not a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from helpers import assert_same_weights, losses, make_cfg
from onegpu import train
from onegpu.checkpoint import local as checkpoint
from onegpu.checkpoint import resume

# Not `serial`: one child at a time on one thread, and every wait is for the child's own progress
# (a checkpoint beyond the last), never a fixed time, so a busy neighbour on the other core only
# shifts where the random kills land. Tiny models run fastest single-threaded.
pytestmark = pytest.mark.usefixtures("one_thread")

RANDOM_KILLS = 20
SAVE_POINTS = checkpoint.SAVE_POINTS


@pytest.fixture(scope="module")
def ctx():
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forkserver: one thread per tiny child
    c = multiprocessing.get_context("forkserver")
    # Everything a child imports lazily, imported once here so that each restart is cheap.
    c.set_forkserver_preload(
        [
            "onegpu.training.run",
            "onegpu.data.records",
            "onegpu.techniques",
            "helpers",
            "accelerate",
            "datasets",
            "transformers.models.llama.modeling_llama",
            "safetensors.torch",
            "transformers.tokenization_utils_tokenizers",
            "deepspeed",
        ]
    )
    yield c
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


def _save_and_die(run_dir: str, step: int, point: str, tokenizer_dir: str) -> None:
    """Child: build the parts, save checkpoint `step`, and SIGKILL itself right after `point`."""
    from transformers import AutoTokenizer

    from helpers import Parts

    torch.manual_seed(step)
    parts = Parts(AutoTokenizer.from_pretrained(tokenizer_dir))
    parts.step()

    def die(at):
        if at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    parts.save(run_dir, step, on_write=die)
    os._exit(0)


def _assert_loads(path, tiny_tokenizer):
    """Weights fit the model and the trainer state passes the weights_only unpickler."""
    from helpers import make_tiny_llama

    assert checkpoint.verify(path) is None
    checkpoint.load_model_weights(path / "model", make_tiny_llama(tiny_tokenizer))
    blob = checkpoint.load_trainer_state(path)
    assert blob["optimizer"]["state"] and "rng" in blob


def test_kill_inside_checkpoint_writes(ctx, tmp_path, tiny_tokenizer, tiny_model_dir):
    from helpers import Parts

    first = Parts(tiny_tokenizer)
    first.step()
    reported = []
    first.save(tmp_path, 1, on_write=reported.append)
    # the kill points below are every write a save makes, in its order ("trash": a step saved again)
    assert reported == [p for p in SAVE_POINTS if p != "trash"]
    again = []
    first.save(tmp_path / "again", 1, on_write=again.append)
    first.save(tmp_path / "again", 1, on_write=again.append)
    assert again == reported + list(SAVE_POINTS)
    for n, point in enumerate(SAVE_POINTS):
        # "trash" only happens when a step is saved again (a run resumed from an earlier point)
        step = 1 if point == "trash" else n + 2
        p = ctx.Process(
            target=_save_and_die, args=(str(tmp_path), step, point, str(tiny_model_dir))
        )
        p.start()
        p.join(60)
        assert p.exitcode == -signal.SIGKILL, (point, p.exitcode)
        latest = resume.resolve_resume("latest", tmp_path)  # what --output.resume latest picks
        assert checkpoint.step_of(latest) == (step if point == "rename" else 1), point
        _assert_loads(latest, tiny_tokenizer)
        assert not list(tmp_path.glob(".*"))  # leftovers of the killed save were tidied away


@pytest.mark.slow
def test_random_kills_during_training_resume_exactly(ctx, tmp_path, tiny_model_dir, tiny_tokenizer):
    cfg = make_cfg(
        tmp_path,
        tiny_model_dir,
        name="killed",
        max_steps=150,
        save_every=1,
        eval_every=0,
        grad_accum=1,
        log_every=1,
    )
    cfg["output"]["keep_last"] = 2
    # Eager: at 150 steps compile=auto would compile, and every restarted child would trace and
    # compile again (4 of its 5.5 s to the first new checkpoint). What is under test is the
    # checkpoint's atomicity and resume; a compiled run's exact resume is
    # test_resume.py::test_a_compiled_run_resumes_exactly.
    cfg["techniques"]["compile"] = "off"
    run_dir = tmp_path / "runs" / "killed"
    rng = random.Random(20261122)
    kills, last_step, mid_write = 0, 0, 0
    while kills < RANDOM_KILLS:
        has_ckpt = checkpoint.find_latest(run_dir) is not None if run_dir.exists() else False
        cfg["output"].update(resume="latest" if has_ckpt else None, overwrite=not has_ckpt)
        p = ctx.Process(target=train, args=(cfg,))
        p.start()
        _wait_for_progress(run_dir, last_step, p)
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, (
            f"run failed instead of being killed (exit {p.exitcode})"
        )
        kills += 1
        mid_write += any(run_dir.glob(".tmp-*"))  # the kill landed inside a checkpoint write
        latest = resume.resolve_resume("latest", run_dir)
        assert checkpoint.step_of(latest) >= last_step
        last_step = checkpoint.step_of(latest)
        _assert_loads(latest, tiny_tokenizer)
    assert last_step < 150, "the run finished before all kills; raise max_steps"
    print(f"{kills} random kills, {mid_write} inside a checkpoint write")
    assert mid_write >= 3, f"only {mid_write} of {kills} kills hit a checkpoint write"
    cfg["output"].update(resume="latest", overwrite=False)
    finished = train(cfg)
    ref_cfg = make_cfg(
        tmp_path,
        tiny_model_dir,
        name="straight",
        max_steps=150,
        save_every=0,
        eval_every=0,
        grad_accum=1,
        log_every=1,
    )
    ref_cfg["techniques"]["compile"] = "off"
    straight = train(ref_cfg)
    train_only = lambda d: [r for r in losses(d) if r[0] == "train"]  # noqa: E731
    assert train_only(finished.run_dir) == train_only(straight.run_dir)
    assert_same_weights(finished.run_dir / "final", straight.run_dir / "final")


def _wait_for_progress(run_dir, last_step: int, proc, timeout: float = 90.0) -> None:
    """Until the child has saved a checkpoint beyond the last one: it is training, not setting
    up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            pytest.fail(f"training child exited with {proc.exitcode} before it was killed")
        steps = (
            [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run_dir)]
            if run_dir.exists()
            else []
        )
        if steps and max(steps) > last_step:
            return
        time.sleep(0.02)
    pytest.fail("training made no progress")
