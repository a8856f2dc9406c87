"""FP8 in `onegpu bench train` and on the next card: the `fp8` arm (the planner's layers on an FP8
card, skipped with the reason elsewhere), the gpu-fp8 presets and scripts/gpu_check.sh's fp8
steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import benchmark_script
from onegpu.hardware import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0))


def _preset_config(name: str, model: str = "1b"):
    from onegpu.bench.settings import BenchTrainConfig
    from onegpu.cli.args import make_parser, parse

    script = benchmark_script("bench_train")
    parser = make_parser("onegpu bench train", "", BenchTrainConfig)
    argv = list(script.PRESETS[name].argv()) + ["--model.name", model]
    return parse(parser, argv, BenchTrainConfig)[0]


def test_the_fp8_arm_takes_the_planners_layers_on_an_fp8_card_and_skips_elsewhere():
    from onegpu.bench.arms import select_arms, skip_reason

    b = _preset_config("gpu-fp8")
    arms = {a.name: a for a in select_arms(b, H100)}
    assert list(arms) == ["baseline", "fp8", "hf-trainer-tuned"]
    assert arms["fp8"].overrides == {
        "techniques.fp8": "tensorwise",
        "techniques.fp8_skip": "k_proj,v_proj",  # GQA's 2048 -> 512 projections lose in float8
    }
    assert skip_reason(arms["fp8"], H100, b, "text") is None
    for device in (A100, DeviceInfo("cpu", "CPU", 8 * 2**30)):
        reason = skip_reason(arms["fp8"], device, b, "text")
        assert device.name in reason and "FP8 tensor cores" in reason


def test_fp8_presets_dry_run_with_their_arms_and_models(tmp_path):
    env = {"ONEGPU_BENCH_WORKDIR": str(tmp_path), "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_train.py", "gpu-fp8", "gpu-fp8-3b", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"{tmp_path}/llama-1b, 4 x 2 x 2048 tokens" in out
    assert f"{tmp_path}/llama-3b, 2 x 8 x 2048 tokens" in out
    arms = re.findall(r"^  (\S+)", out, re.M)
    assert arms == ["baseline", "fp8", "hf-trainer-tuned", "baseline", "fp8"]
    assert not list(tmp_path.iterdir())  # a dry run writes no model


def test_gpu_check_has_fp8_steps_that_skip_without_a_card(tmp_path):
    import os

    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path), "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "fp8", "fp8-3b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:]
    for step in ("fp8", "fp8-3b"):
        assert re.search(rf"^SKIP\s+{step}\s.*no CUDA GPU", summary, re.M), summary
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "bench_train.py gpu-fp8 " in script and "bench_train.py gpu-fp8-3b " in script
