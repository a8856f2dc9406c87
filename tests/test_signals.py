"""SIGTERM/SIGINT: finish the micro-batch, checkpoint, exit 0 with the resume command; a second
signal exits at once. Real `onegpu train` subprocesses (both started together to share the wait)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from helpers import write_data
from onegpu.checkpoint import local as checkpoint
from onegpu.cli.main import main
from onegpu.report import read_metrics

# serial: signals to training processes, waited for by the clock
# tiny models run fastest single-threaded
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.serial]

LAUNCH = "import sys; from onegpu.cli.main import main; sys.exit(main(sys.argv[1:]))"


def train_args(tmp_path, model_dir, name: str) -> list[str]:
    return [
        "train",
        "--model.name",
        str(model_dir),
        "--data.path",
        str(tmp_path / "data.jsonl"),
        "--data.seq_len",
        "32",
        "--data.num_proc",
        "1",
        "--training.micro_batch_size",
        "2",
        "--training.grad_accum",
        "2",
        "--training.max_steps",
        "100000",
        "--training.eval_every",
        "0",
        "--training.log_every",
        "1",
        "--training.warmup_steps",
        "2",
        "--output.dir",
        str(tmp_path / "runs"),
        "--output.name",
        name,
        "--output.report_to",
        "none",
    ]


# The second-signal run trains eagerly: a compile from a cold cache cost the fast tier's test 25
# CPU seconds, and what it checks (a second signal exits at once) is the loop's, not the compiler's.
# The SIGTERM run (slow tier) keeps the default job's compile.
EXTRA = {"term": [], "twice": ["--techniques.compile", "off"]}


class Runs:
    """The module's training processes, each started when its test asks for it (``start``): in
    the fast tier the SIGTERM run (slow, compiled) is never started, and in the whole suite the two
    do not share the cores while either is timed."""

    def __init__(self, tmp, model_dir):
        self.tmp, self.model_dir = tmp, model_dir
        self.env = dict(
            os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
        )
        self.started, self.files = {}, []

    def start(self, name: str) -> subprocess.Popen:
        # output to files: the test reads stderr while the process still runs
        self.files += [open(self.tmp / f"{name}.out", "w"), open(self.tmp / f"{name}.err", "w")]
        self.started[name] = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, *train_args(self.tmp, self.model_dir, name)]
            + EXTRA[name],
            env=self.env,
            stdout=self.files[-2],
            stderr=self.files[-1],
            text=True,
        )
        return self.started[name]

    def close(self) -> None:
        for f in self.files:
            f.close()
        for p in self.started.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def procs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("signals")
    write_data(tmp)
    runs = Runs(tmp, tiny_model_dir)
    yield tmp, runs
    runs.close()


def finish(tmp, name, proc, timeout=120) -> tuple[str, str]:
    proc.wait(timeout=timeout)
    return (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text()


def wait_for(path, text: str, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no '{text}' in {path}"
        time.sleep(0.005)


def wait_training(run_dir, proc, timeout=180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (run_dir.parent.parent / f"{run_dir.name}.err").read_text()[
            -2000:
        ]
        path = run_dir / "metrics.jsonl"
        if path.is_file() and any(
            r["split"] == "train" for r in read_metrics(path) if r.get("step")
        ):
            return
        time.sleep(0.05)
    pytest.fail("training did not start")


@pytest.mark.slow
def test_sigterm_saves_checkpoint_and_prints_resume_command(procs, tiny_model_dir):
    tmp, runs = procs
    proc, run_dir = runs.start("term"), tmp / "runs" / "term"
    wait_training(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(tmp, "term", proc)
    assert proc.returncode == 0, err[-2000:]
    assert "SIGTERM: finishing the current micro-batch" in err
    m = re.search(
        r"stopped by SIGTERM at step (\d+); checkpoint saved: (\S+)\nresume with: (.+)", out
    )
    assert m, out
    step, ckpt, command = int(m.group(1)), m.group(2), m.group(3)
    assert command == f"onegpu train --config {run_dir / 'config.yaml'} --output.resume latest"
    assert checkpoint.verify(ckpt) is None and checkpoint.step_of(ckpt) == step
    assert not (run_dir / "final").exists()  # a stopped run is not a finished one
    # the printed command works as is (only the length is shortened for the test)
    assert main(shlex.split(command)[1:] + ["--training.max_steps", str(step + 2)]) == 0
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, step + 3))
    assert (run_dir / "final" / "model.safetensors").is_file()


# slow: a training child from a cold start, and in a fresh pass the session's tiny model built in
# its setup: 19.6 CPU s alone, 22.1 in the whole suite's serial pass (the guard's limit is 20)
@pytest.mark.slow
def test_second_sigint_exits_at_once(procs):
    tmp, runs = procs
    proc, run_dir = runs.start("twice"), tmp / "runs" / "twice"
    wait_training(run_dir, proc)
    proc.send_signal(signal.SIGINT)
    # Python coalesces two signals that arrive before its handler runs: wait for the first to land
    wait_for(tmp / "twice.err", "SIGINT: finishing the current micro-batch")
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, err = finish(tmp, "twice", proc, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err[-2000:])
    assert "SIGINT again: exiting now" in err and time.monotonic() - t0 < 30
    assert "resume with" not in out
    # whatever it was writing is not a checkpoint anyone will pick
    for p in checkpoint.list_checkpoints(run_dir):
        assert checkpoint.verify(p) is None
