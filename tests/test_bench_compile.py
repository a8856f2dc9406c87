"""`onegpu bench train` compares like with like: on a GPU our arms compile as a default run of
realistic length does (the H100's headline read 0.81x HF Trainer because our 10-step baseline ran
eager against a compiled Trainer), the compile's cost is reported as start-up seconds, and every
headline line says which side compiled."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from onegpu.bench import arms as bench_arms
from onegpu.bench import train as bench_train
from onegpu.bench import train_report
from onegpu.bench.settings import BenchTrainConfig
from onegpu.bench.train_child import timing_from_windows
from onegpu.hardware import DeviceInfo

CPU = DeviceInfo("cpu", "CPU", 8 * 2**30)
H100 = DeviceInfo("cuda", "NVIDIA H100", 80 * 2**30, (9, 0))


@pytest.fixture
def triton(monkeypatch):
    """A GPU machine's triton (compile=auto on CUDA asks for it), here where none is installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "triton" else real(name, *a),
    )


def _arm_compile(b: BenchTrainConfig, device: DeviceInfo, name: str) -> str:
    arm = {a.name: a for a in bench_arms.select_arms(b, device)}[name]
    base = bench_train.base_config(b, "/tmp/unused")
    return bench_train.arm_config(arm, base, b, 0, device.type)["techniques"]["compile"]


def test_gpu_arms_compile_as_a_long_default_run(triton):
    """10 steps on a GPU: auto alone would stay eager; the arms compile as a 50+-step default run
    does, and where auto refuses (offload) they stay eager; the peers are left as they are."""
    b = BenchTrainConfig()
    assert b.training.max_steps < 50
    assert _arm_compile(b, H100, "baseline") == "default"
    assert _arm_compile(b, H100, "flash") == "default"
    assert _arm_compile(b, H100, "offload") == "off"  # auto's own rule for offloaded state
    assert _arm_compile(b, H100, "eager") == "off"
    assert _arm_compile(b, H100, "hf-trainer-tuned") == "auto"  # a peer: its own flags decide
    assert bench_arms.baseline_compiles(b, "cuda")
    arms = {a.name: a for a in bench_arms.select_arms(b, H100)}
    assert "compiles already" in bench_arms.skip_reason(arms["compile"], H100, b, "text")
    assert bench_arms.skip_reason(arms["eager"], H100, b, "text") is None
    b.techniques.compile = "off"  # asked for: kept, and then the compile arm measures it
    assert _arm_compile(b, H100, "baseline") == "off"
    assert not bench_arms.baseline_compiles(b, "cuda")


def test_cpu_arms_keep_auto_by_the_run_length(triton):
    """On a CPU the default compiles only runs of 50+ steps: a 10-step bench stays eager (the
    compile arm measures compiling), a 60-step one compiles as `onegpu train` would."""
    b = BenchTrainConfig()
    assert _arm_compile(b, CPU, "baseline") == "auto"
    assert not bench_arms.baseline_compiles(b, "cpu")
    arms = {a.name: a for a in bench_arms.select_arms(b, CPU)}
    assert "eager already" in bench_arms.skip_reason(arms["eager"], CPU, b, "text")
    b.training.max_steps = 60
    assert bench_arms.baseline_compiles(b, "cpu") == _has_gxx()


def _has_gxx() -> bool:
    from onegpu.techniques.compile import has_cpu_compiler

    return has_cpu_compiler()


def test_gpu_without_triton_stays_eager_and_dpo_keeps_auto(triton, monkeypatch):
    b = BenchTrainConfig()
    b.training.objective = "dpo"
    assert _arm_compile(b, H100, "baseline") == "auto"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert _arm_compile(BenchTrainConfig(), H100, "baseline") == "off"


def test_startup_is_the_untimed_steps_beyond_the_steady_rate():
    """4 untimed steps took 14 s, the 8 timed ones 8 s: 10 s of start-up (the compile)."""
    records = [
        {"step": 4, "tokens_seen": 400, "tokens_per_s": 400 / 14, "loss": 5.0},
        {"step": 8, "tokens_seen": 800, "tokens_per_s": 100.0, "loss": 4.0},
        {"step": 12, "tokens_seen": 1200, "tokens_per_s": 100.0, "loss": 3.0},
    ]
    t = timing_from_windows(records, warmup=4)
    assert t["timed_seconds"] == pytest.approx(8.0)
    assert t["startup_s"] == pytest.approx(10.0)
    assert timing_from_windows(records[:1], warmup=4)["startup_s"] is None


def _doc(device: DeviceInfo, arms: dict) -> dict:
    b = BenchTrainConfig()
    doc = {
        "config": dataclasses.asdict(b),
        "device": {"type": device.type, "name": device.name, "memory_gb": 80},
        "setup": {
            "flops_per_token": 1e6,
            "peak_flops": 1e12,
            "peak_dtype": "bf16",
            "model_name": "1b",
            "params": 1e9,
        },
        "versions": dict.fromkeys(
            ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "trl", "python"), "x"
        ),
        "date": "d",
        "command": "c",
        "commit": "abc1234",
        "arms": {},
    }
    for name, (kind, tokens, startup, compiled) in arms.items():
        rep = {
            "status": "ok",
            "rep": 0,
            "timed_steps": 8,
            "timed_tokens": tokens,
            "timed_seconds": 1.0,
            "startup_s": startup,
            "train_mem_mb": 100.0,
            "final_loss": 1.0,
            "evidence": {"compiled": compiled},
        }
        doc["arms"][name] = {"name": name, "row": name, "kind": kind, "status": "ok"}
        doc["arms"][name].update(overrides={}, reason=None, reps=[rep])
    return train_report.summarize(doc)


def test_headline_says_which_side_compiled_and_the_start_up():
    doc = _doc(
        H100,
        {
            "baseline": ("onegpu", 70_240, 11.0, True),
            "hf-trainer-tuned": ("hf", 59_918, 37.0, True),
            "trl-sft": ("trl", 35_801, 2.0, False),
        },
    )
    md = train_report.markdown(doc)
    assert (
        "- **onegpu `baseline` (compiled) vs HF Trainer (guide's flags) (compiled): 1.17x "
        "tokens/s, 1.00x memory.** Start-up 11 s vs 37 s." in md
    )
    assert (
        "vs TRL SFTTrainer (defaults) (eager): 1.96x tokens/s, 1.00x memory.** Start-up 11 s " in md
    )
    assert "not like for like: only one side compiled." in md.split("TRL SFTTrainer")[1]
    assert "on a GPU our arms run as a default run of 50+ steps does" in md
    assert "| baseline |  | 1.00x | 1.00x | 70,240 | 11.0 |" in md


def test_headline_flags_an_eager_baseline_against_a_compiled_peer():
    """The H100's run as it was: our baseline eager at 10 steps, Trainer compiled."""
    doc = _doc(
        CPU,
        {
            "baseline": ("onegpu", 47_832, 0.5, False),
            "hf-trainer-tuned": ("hf", 59_214, 37.0, True),
        },
    )
    md = train_report.markdown(doc)
    line = next(x for x in md.splitlines() if "HF Trainer (guide's flags)" in x and "- **" in x)
    assert "`baseline` (eager) vs HF Trainer (guide's flags) (compiled): 0.81x" in line
    assert line.endswith("not like for like: only one side compiled.")
    assert "on a CPU compile=auto decides by the run's own length (10 steps: eager" in md


def test_dry_run_shows_the_settled_compile(triton, monkeypatch, capsys):
    from onegpu import hardware

    monkeypatch.setattr(hardware, "detect", lambda: H100)
    b = BenchTrainConfig()
    b.bench.arms = "baseline,offload,compile,eager,hf-trainer-tuned"
    assert bench_train.dry_run(b) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()[1:])
    assert listed["baseline"] == "- [compile default: as a default run of 50+ steps]"
    assert listed["offload"] == (
        "techniques.offload=zero2-cpu [compile off: as a default run of 50+ steps]"
    )
    assert listed["compile"].startswith("skip: the baseline compiles already")
    assert listed["eager"] == "techniques.compile=off"
    assert listed["hf-trainer-tuned"] == "HF Trainer"


def test_dpo_headline_says_which_side_compiled():
    doc = _doc(
        H100,
        {"baseline": ("onegpu", 9_488, 3.0, False), "trl-dpo": ("trl-dpo", 1_088, 5.0, False)},
    )
    doc["config"]["training"]["objective"] = "dpo"
    doc["setup"]["train_examples"] = 80
    md = train_report.markdown(train_report.summarize(doc))
    assert "- **onegpu `baseline` (eager) vs TRL DPOTrainer (defaults) (eager): 8.72x" in md
