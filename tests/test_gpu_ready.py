"""What a GPU machine would run, checked here on the CPU, so that GPU time is not spent on errors a
CPU can catch: the GPU tier collects, every benchmark preset parses and lists the arms it should,
the GPU presets fit their time and memory, and scripts/gpu_check.sh runs, times out and summarises.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# What the GPU presets must measure between them (benchmarks/bench_train.py).
GPU_ARMS = {
    "gpu-quick": ["baseline", "hf-trainer-tuned", "trl-sft"],
    "gpu-best": ["baseline", "best", "hf-trainer"],
    "gpu-memory": ["baseline", "batch-size", "grad-accum", "checkpointing"],
    "gpu-precision": ["baseline", "fp32", "fp32-tf32", "fp16"],
    "gpu-kernels": ["baseline", "flash", "eager"],
    "gpu-optim": ["baseline", "adamw-fused", "adafactor", "adamw-8bit"],
    "gpu-offload": ["baseline", "offload", "preload"],
    "gpu-peft": ["baseline", "lora", "qlora", "plain-loss"],
    "gpu-chat": ["baseline", "padding-free", "hf-trainer", "trl-sft"],
    "gpu-dpo": ["baseline", "lora", "trl-dpo", "trl-dpo-lora"],
}
# The guide's table, each method alone (bf16 is the GPU baseline, measured against the fp32 arm),
# the best set, PEFT, padding vs packing, and the three peers at their defaults / the guide's flags.
MUST_COVER = {
    "batch-size",
    "grad-accum",
    "checkpointing",
    "fp32",
    "fp16",
    "fp32-tf32",
    "flash",
    "adamw-fused",
    "adafactor",
    "adamw-8bit",
    "preload",
    "eager",
    "offload",
    "lora",
    "qlora",
    "best",
    "padding-free",
    "hf-trainer",
    "hf-trainer-tuned",
    "trl-sft",
    "trl-dpo",
    "trl-dpo-lora",
}


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout
    )


def test_gpu_tier_collects_without_errors():
    """An import error or a bad fixture in tests/gpu would otherwise surface only on the GPU
    machine."""
    proc = _run(
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/gpu",
        "-m",
        "gpu",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "error" not in out.lower(), out[-3000:]
    collected = [line for line in proc.stdout.splitlines() if line.startswith("tests/gpu/")]
    files = {line.split("::")[0] for line in collected}
    assert len(files) == len(
        list((ROOT / "tests" / "gpu").glob("test_*.py"))
    )  # every file, offload included
    assert len(collected) >= 20 and re.search(rf"\b{len(collected)} tests? collected", proc.stdout)


def test_ds_accelerator_is_left_to_deepspeed_where_cuda_exists():
    """conftest names DeepSpeed's CPU accelerator only without CUDA; with CUDA the offload tests and
    their subprocesses keep DeepSpeed's own (CUDA) choice."""
    code = (
        "import os, sys, torch; sys.path.insert(0, 'tests'); torch.cuda.is_available = lambda: "
        "{cuda}; import conftest; print(os.environ.get('DS_ACCELERATOR'))"
    )
    env = {k: v for k, v in ENV.items() if k != "DS_ACCELERATOR"}
    for cuda, expected in ((True, "None"), (False, "cpu")):
        proc = _run(sys.executable, "-c", code.format(cuda=cuda), env=env)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, proc.stderr[-2000:]


def _sections(out: str) -> dict[str, list[str]]:
    """Dry-run output -> {preset: [arm lines]}."""
    sections, current = {}, None
    for line in out.splitlines():
        m = re.match(r"== preset (\S+):", line)
        if m:
            current = sections.setdefault(m.group(1), [])
        elif current is not None and line.startswith("  "):
            current.append(line.strip())
    return sections


def test_every_bench_train_preset_dry_runs_with_the_expected_arms(tmp_path):
    """Each preset's flags parse and validate, and it lists exactly its arms; nothing is written."""
    env = {**ENV, "ONEGPU_BENCH_WORKDIR": str(tmp_path / "work")}
    proc = _run(
        sys.executable,
        "benchmarks/bench_train.py",
        "cpu",
        "headline",
        "cpu-dpo",
        "gpu",
        "gpu-grpo",
        "--dry-run",
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    sections = _sections(proc.stdout)
    from onegpu.bench.arms import all_arms, dpo_arms
    from onegpu.bench.settings import BenchTrainConfig

    names = lambda lines: [line.split()[0] for line in lines]  # noqa: E731
    assert names(sections["cpu"]) == [a.name for a in all_arms(BenchTrainConfig())]
    assert names(sections["cpu-dpo"]) == [a.name for a in dpo_arms()]
    assert names(sections["headline"]) == [
        "baseline",
        "plain-loss",
        "hf-trainer",
        "hf-trainer-tuned",
    ]
    for preset, arms in GPU_ARMS.items():
        assert names(sections[preset]) == arms, preset
    assert set().union(*GPU_ARMS.values()) >= MUST_COVER
    assert not (tmp_path / "work").exists()  # a dry run writes no model and no chat data
    for preset in GPU_ARMS:  # every GPU arm trains the saved ~1B model at seq 2048, and so on
        assert f"llama-1b, 4 x 2 x 2048 tokens, 10 steps, 2 reps [train-{preset}-" in proc.stdout
    memory = dict(line.split(None, 1) for line in sections["gpu-memory"])
    assert (
        "training.micro_batch_size=8, training.grad_accum=1" in memory["batch-size"]
    )  # capped: fits 80 GB
    # on this CPU the GPU-only arms say why they would not run, and TRL is installed
    precision = dict(line.split(None, 1) for line in sections["gpu-precision"])
    assert (
        precision["fp16"].startswith("skip: ") and precision["fp32"] == "techniques.precision=fp32"
    )
    assert (
        dict(line.split(None, 1) for line in sections["gpu-quick"])["trl-sft"] == "TRL SFTTrainer"
    )
    dpo = dict(line.split(None, 1) for line in sections["gpu-dpo"])
    assert (
        dpo["trl-dpo"] == "TRL DPOTrainer"
        and dpo["trl-dpo-lora"] == "TRL DPOTrainer (techniques.lora.enabled=True)"
    )
    assert re.search(r"2 reps \[train-gpu-dpo-\d+\]; objective dpo", proc.stdout)
    # GRPO on the card: the default job's model, our GRPO against TRL's GRPOTrainer, 2 rounds
    assert names(sections["gpu-grpo"]) == ["baseline", "compile", "trl-grpo"]
    grpo = dict(line.split(None, 1) for line in sections["gpu-grpo"])
    # dry-run here, the compile arm is listed by what it sets; on a card it skips itself
    assert grpo["compile"] == "techniques.compile=default"
    assert re.search(r"2 reps \[train-gpu-grpo-\d+\]; objective grpo", proc.stdout)


def test_gpu_presets_fit_a_ten_minute_command():
    """The estimates (seconds per arm at the GPU shape) keep every preset near 8 minutes, and the
    presets' table in benchmarks/README.md shows what the estimator says."""
    script = benchmark_script("bench_train")
    table = (ROOT / "benchmarks" / "README.md").read_text()
    for name, preset in script.PRESETS.items():
        if not preset.gpu:
            continue
        minutes = script.estimate_seconds(preset) / 60
        assert minutes <= 8.0, (name, minutes)
        row = re.search(rf"^\| `{name}` \|.*\| (\d+\.\d)\b[^|]*\|$", table, re.M)
        assert row and float(row.group(1)) == round(minutes, 1), name
        assert list(("baseline",) + preset.arms) == GPU_ARMS[name]
        assert all(arm in script.ARM_SECONDS for arm in preset.arms)
    assert script.GROUPS["gpu"] == list(GPU_ARMS)


def test_gpu_presets_write_the_model_and_the_chat_data_once(tmp_path):
    """The saved model and the chat set are written once per work folder (under a temporary name,
    renamed when complete) and every later preset reuses them."""
    script = benchmark_script("bench_train")
    work = tmp_path / "work"
    model = script.saved_model(
        work / "llama-1b", preset="tiny", max_bytes=200_000
    )  # stands in for the 1b
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model.iterdir()
    }
    written = (model / "model.safetensors").stat().st_mtime_ns
    for name in ("gpu-chat", "gpu-peft"):
        argv = script.preset_argv(script.PRESETS[name], work, "20990101", dry_run=False)
        assert argv[argv.index("--model.name") + 1] == str(model)
        assert argv[argv.index("--bench.name") + 1] == f"train-{name}-20990101"
    assert "--data.path" not in argv  # gpu-peft trains on packed text
    assert (model / "model.safetensors").stat().st_mtime_ns == written  # reused, not written again
    chat = work / "chat.jsonl"
    assert chat.is_file() and len(chat.read_text().splitlines()) > 1000
    assert sorted(p.name for p in work.iterdir()) == [
        "chat.jsonl",
        "llama-1b",
    ]  # no half-written leftovers


def test_every_gpu_preset_arm_fits_80_gb_by_the_planners_estimate():
    """The planner's memory model (CPU-measured activations) for each GPU arm's micro-batch and
    precision, with the full logits (the worst case): all fit an 80 GB H100, while the uncapped
    batch-size arm (16 x 2048) would not. DPO arms run two sequences a pair, all of seq_len (the
    worst case: the corpus pairs are far shorter), and TRL's full arm keeps a frozen copy of the
    model."""
    from onegpu.bench.arms import all_arms
    from onegpu.bench.settings import BenchTrainConfig
    from onegpu.cli.args import make_parser, parse
    from onegpu.plan import memory
    from onegpu.plan.arch import model_shape
    from onegpu.plan.candidate import setup

    script, capacity = benchmark_script("bench_train"), 80 * 2**30
    shape = model_shape("1b", 4096)
    parser = make_parser("onegpu bench train", "", BenchTrainConfig)
    # their own defaults: HF Trainer fp32, the guide's flags and TRL bf16; TRL checkpoints by
    # default
    peers = {"hf-trainer": "fp32", "hf-trainer-tuned": "bf16", "trl-sft": "bf16"}
    trl = {"trl-sft", "trl-dpo", "trl-dpo-lora"}
    checked = set()
    for preset, arm_names in GPU_ARMS.items():
        b, _ = parse(parser, list(script.PRESETS[preset].args), BenchTrainConfig)
        arms = {a.name: a for a in all_arms(b)}
        for name in arm_names:
            o = arms[name].overrides
            lora = o.get("techniques.lora.enabled", False)
            reference = {"trl-dpo": "copy"}.get(
                name, o.get("preference.reference", b.preference.reference)
            )
            c = setup(
                o.get("training.micro_batch_size", b.training.micro_batch_size),
                o.get("training.grad_accum", b.training.grad_accum),
                precision=peers.get(name) or o.get("techniques.precision", b.techniques.precision),
                checkpointing="full" if name in trl else o.get("techniques.checkpointing", "off"),
                lora={"r": b.techniques.lora.r, "enabled": lora},
                training={"objective": b.training.objective},
                preference={"reference": reference},
            )
            assert memory.estimate(shape, c, b.data.seq_len).fits(capacity), (
                preset,
                name,
                c.label(),
            )
            checked.add(name)
    assert checked == set().union(*GPU_ARMS.values())
    assert not memory.estimate(shape, setup(16, 1, precision="bf16"), b.data.seq_len).fits(capacity)


def test_bench_infer_gpu_preset_dry_runs():
    proc = _run(
        sys.executable,
        "-m",
        "onegpu.cli.main",
        "bench",
        "infer",
        "--preset",
        "hf-gpu",
        "--dry_run",
        "true",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    listed = [line.strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert listed[0] == "hf-default" and {"bf16", "nf4", "ao-int8", "bf16+static-compile"} <= set(
        listed
    )
    assert "dry run: 1b on cuda" in proc.stdout


@pytest.mark.skipif(
    not Path("/usr/bin/timeout").exists() and not Path("/bin/timeout").exists(),
    reason="needs coreutils timeout",
)
def test_gpu_check_script_runs_steps_times_out_and_summarises(tmp_path):
    """scripts/gpu_check.sh with plain python and PYTHONPATH=src: a step that passes, a benchmark
    step skipped without CUDA, a step killed by its timeout, an unknown step; all in summary.txt."""
    env = {
        **ENV,
        "GPU_CHECK_DIR": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "TIMEOUT_DRY": "1",
    }
    env.pop("OUT", None)
    proc = _run(
        "bash", "scripts/gpu_check.sh", "versions", "quick", "dry", "nope", env=env, timeout=180
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"^PASS\s+versions\s", summary, re.M), summary
    assert re.search(r"^SKIP\s+quick\s.*no CUDA GPU", summary, re.M), summary
    assert re.search(r"^TIMEOUT\s+dry\s", summary, re.M), summary
    assert re.search(r"^FAIL\(2\)\s+nope\s", summary, re.M), summary
    versions = (tmp_path / "out" / "versions.txt").read_text()
    assert re.search(r"^torch \d", versions, re.M) and re.search(r"^trl ", versions, re.M)
    assert (tmp_path / "out" / "dry.log").exists() and (tmp_path / "out" / "versions.log").exists()


def test_gpu_check_steps_each_fit_ten_minutes():
    """Every step of scripts/gpu_check.sh has a command of its own and runs under a timeout whose
    limit plus the kill grace stays within the GPU machine's 600 s a command; the GRPO preset and
    the generation engine's `infer` step are among them."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    grace = int(re.search(r"timeout --kill-after=(\d+) ", script).group(1))
    proc = _run(
        "bash",
        "-c",
        'eval "$(sed -n "/^ALL=/p;/^default_timeout()/,/^}/p" scripts/gpu_check.sh)"; '
        'for s in "${ALL[@]}"; do echo "$s $(default_timeout "$s")"; done',
    )
    limits = dict(line.split() for line in proc.stdout.splitlines())
    assert {"grpo", "infer", "quick", "tests"} <= set(limits), proc.stdout + proc.stderr
    commands = script[script.index("step_cmd() {") : script.index("needs_gpu()")]
    for step, limit in limits.items():
        assert int(limit) + grace <= 600, (step, limit)
        assert re.search(rf"^\s+{re.escape(step)}\) ", commands, re.M), step
    assert "bench infer --preset gpu" in commands and "bench_train.py gpu-grpo" in commands
