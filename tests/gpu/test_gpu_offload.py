"""ZeRO-Offload on one GPU: a model whose fp32 weights, gradients and Adam state (16 bytes per
parameter, ~15 GiB for this 0.94B-parameter Llama) do not fit in a 6 GiB memory cap trains with
techniques.offload=zero3-cpu (parameters and optimizer state in CPU memory, DeepSpeed's CPU Adam),
while the same run without offload runs out of memory. Skipped without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.gpu

CAP_GIB = 6.0
SCRIPT = Path(__file__).parents[1] / "dist_scripts" / "capped_train.py"


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory, tiny_tokenizer):
    from helpers import make_tiny_llama

    path = tmp_path_factory.mktemp("llama-0.9b")
    model = make_tiny_llama(
        tiny_tokenizer,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )
    assert (
        sum(p.numel() for p in model.parameters()) * 16 > 2 * CAP_GIB * 2**30
    )  # cannot fit un-offloaded
    model.save_pretrained(str(path))
    tiny_tokenizer.save_pretrained(str(path))
    return path


def _run(
    tmp_path: Path, model_dir: Path, text_file: Path, name: str, offload: str
) -> subprocess.CompletedProcess:
    cfg = {
        "model": {"name": str(model_dir)},
        "data": {"path": str(text_file), "seq_len": 128, "num_proc": 1},
        "training": {
            "micro_batch_size": 2,
            "grad_accum": 2,
            "max_steps": 3,
            "log_every": 1,
            "eval_every": 0,
            "oom_retry": False,
        },
        "techniques": {"precision": "bf16", "offload": offload},
        "output": {"dir": str(tmp_path / "runs"), "name": name, "report_to": "none"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(CAP_GIB), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_zero3_cpu_offload_trains_a_model_that_does_not_fit(tmp_path, big_model_dir, text_file):
    plain = _run(tmp_path, big_model_dir, text_file, "plain", "none")
    assert plain.returncode != 0 and "out of memory" in (plain.stderr + plain.stdout).lower(), (
        plain.stderr[-3000:]
    )
    off = _run(tmp_path, big_model_dir, text_file, "zero3", "zero3-cpu")
    assert off.returncode == 0, off.stderr[-6000:]
    out = off.stdout + off.stderr
    assert "DeepSpeed ZeRO-3 with zero3-cpu offload" in out
    assert "DeepSpeedCPUAdam" in out  # the vectorised CPU optimizer ran the offloaded step
    peak = float(out.split("peak_gib=")[1].split()[0])
    assert peak < CAP_GIB
    print(f"zero3-cpu peak GPU memory {peak:.2f} GiB under a {CAP_GIB} GiB cap")  # recorded with -s


def test_zero2_cpu_offload_keeps_optimizer_state_off_the_gpu(tmp_path, tiny_model_dir, text_file):
    plain = _run(tmp_path, tiny_model_dir, text_file, "plain-small", "none")
    off = _run(tmp_path, tiny_model_dir, text_file, "zero2", "zero2-cpu")
    assert plain.returncode == 0 and off.returncode == 0, (plain.stderr + off.stderr)[-6000:]
    assert "DeepSpeed ZeRO-2 with zero2-cpu offload" in off.stdout + off.stderr
    # Read off the live optimizer at the end of training: the state is in host memory, held by
    # DeepSpeed's CPU Adam; without offload the same run keeps it on the GPU.
    assert "optimizer=DeepSpeedCPUAdam state_devices=cpu" in off.stdout, off.stdout[-2000:]
    assert "state_devices=cuda" in plain.stdout, plain.stdout[-2000:]
