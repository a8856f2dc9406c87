"""`onegpu bench train`: the guide's technique table, measured on this machine, next to HF Trainer.

Every arm is one setting of the run ``Config`` (so methods show up here as soon as they exist),
trained for the same steps on the same tokenized data and effective batch. Arms run in a fresh
subprocess each (clean peak memory) and repetitions are interleaved — A, B, C, A, B, C — so slow
drift of a shared machine hits every arm alike. Every ratio in the report comes from one run.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from onegpu.config import Config, DataConfig, ModelConfig, OutputConfig, TrainingConfig, to_dict
from onegpu.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class BenchSettings:
    """How the benchmark runs (the arms' run settings are the Config sections beside this one)."""

    warmup_steps: int = 2
    """Leading steps left out of the timing (allocator warm-up, compilation); also the logging interval."""
    max_seconds: float = 120.0
    """Time budget of one arm's training loop; an arm that runs out reports the steps it finished."""
    reps: int = 3
    """Repetitions of every arm, interleaved (A, B, C, A, B, C, ...)."""
    arms: str = "all"
    """Comma-separated arm names, or "all". The baseline arm is always included."""
    best: str = "auto"
    """Arms merged into the "best" arm (comma-separated), or "auto" for this device's recommended set."""
    out: str = "benchmarks/results"
    """Folder for the results (json, md, png)."""
    name: Optional[str] = None
    """File stem of the results (default: train-<device>-<date>)."""
    dry_run: bool = False
    """Check the settings and list the arms this device would run (and why others are skipped),
    without tokenizing or training anything."""


def _bench_model() -> ModelConfig:
    return ModelConfig(name="tiny", from_scratch=True)


def _bench_data() -> DataConfig:
    return DataConfig(seq_len=256, max_bytes=1_000_000, num_proc=1)


def _bench_training() -> TrainingConfig:
    # No learning-rate warm-up: HF's schedule starts warm-up at lr 0 and ours at lr/warmup; without
    # it both are the same cosine, so the final losses are comparable. No evaluation: not timed.
    return TrainingConfig(micro_batch_size=8, grad_accum=2, max_steps=10, warmup_steps=0, eval_every=0,
                          eval_batches=1)


def _bench_output() -> OutputConfig:
    return OutputConfig(tensorboard=False)


@dataclass
class BenchTrainConfig(Config):
    """The baseline arm's run ``Config`` (every section and flag of `onegpu train`, with defaults
    for a quick sweep: the tiny preset, 8 x 2 sequences of 256 tokens, 10 steps) plus ``bench``.
    Each arm overrides a few of its keys; the effective batch is kept by every arm."""

    model: ModelConfig = field(default_factory=_bench_model)
    data: DataConfig = field(default_factory=_bench_data)
    training: TrainingConfig = field(default_factory=_bench_training)
    output: OutputConfig = field(default_factory=_bench_output)
    bench: BenchSettings = field(default_factory=BenchSettings)


@dataclass
class Arm:
    name: str
    row: str  # the guide's table row this arm measures
    overrides: dict = field(default_factory=dict)  # dotted Config keys -> values
    kind: str = "onegpu"  # "onegpu" or "hf"
    needs: Optional[Callable] = None  # (device, bench cfg, data format) -> reason it cannot run, or None


# ------------------------------------------------------------------------------------------ arms
def _cuda(what: str):
    return lambda dev, b, fmt: None if dev.type == "cuda" else f"{what} needs a CUDA GPU"


FP16_CPU = "fp16 math is emulated on a CPU (many times slower than fp32); measured on CUDA GPUs only"


def _cuda_only(reason: str):
    return lambda dev, b, fmt: None if dev.type == "cuda" else reason


def _ampere(what: str):
    return lambda dev, b, fmt: None if dev.bf16 else f"{what} needs an Ampere-or-newer CUDA GPU"


def _module(mod: str):
    def check(dev, b, fmt):
        import importlib.util

        return None if importlib.util.find_spec(mod) else f"{mod} is not installed"
    return check


def _all(*checks):
    return lambda dev, b, fmt: next((r for r in (c(dev, b, fmt) for c in checks) if r), None)


def _compiler(dev, b, fmt):
    from onegpu.techniques.compile import has_cpu_compiler

    if dev.type == "cpu" and not has_cpu_compiler():
        return "torch.compile on CPU needs a C++ compiler (g++)"
    return None


def _trained(dev, b, fmt):
    from onegpu.models import is_preset

    if is_preset(b.model.name) or b.model.from_scratch:
        return ("QLoRA quantizes a trained model: give --model.name a saved model directory "
                "(and --model.from_scratch false)")
    return None


def _padded(dev, b, fmt):
    return None if fmt != "text" else "text data is packed into full blocks already: no padding to remove"


def all_arms(b: BenchTrainConfig) -> list[Arm]:
    """The guide's rows, one setting each; the baseline first, HF Trainer last."""
    eff = b.training.micro_batch_size * b.training.grad_accum
    small = max(1, b.training.micro_batch_size // 4)
    return [
        Arm("baseline", "onegpu baseline", {}),
        Arm("batch-size", "Batch size choice", {"training.micro_batch_size": eff, "training.grad_accum": 1}),
        Arm("grad-accum", "Gradient accumulation",
            {"training.micro_batch_size": small, "training.grad_accum": eff // small}),
        Arm("checkpointing", "Gradient checkpointing", {"techniques.checkpointing": "full"}),
        Arm("bf16", "Mixed precision (bf16)", {"techniques.precision": "bf16"}),
        Arm("fp16", "Mixed precision (fp16)", {"techniques.precision": "fp16"}, needs=_cuda_only(FP16_CPU)),
        Arm("tf32", "Mixed precision (tf32)", {"techniques.tf32": True}, needs=_ampere("tf32")),
        Arm("flash", "Flash Attention", {"techniques.attention": "flash"}, needs=_cuda("FlashAttention")),
        Arm("adamw-fused", "Optimizer choice (fused AdamW)", {"techniques.optimizer": "adamw-fused"}),
        Arm("adafactor", "Optimizer choice (Adafactor)", {"techniques.optimizer": "adafactor"}),
        Arm("adamw-8bit", "Optimizer choice (8-bit AdamW)", {"techniques.optimizer": "adamw-8bit"},
            needs=_module("bitsandbytes")),
        Arm("preload", "Data preloading", {"data.num_workers": 2, "data.pin_memory": True}),
        Arm("compile", "torch.compile", {"techniques.compile": "default"}, needs=_compiler),
        Arm("plain-loss", "Plain cross-entropy (full logits, not fused)", {"techniques.loss": "plain"}),
        Arm("padding-free", "Packing instead of padding", {"techniques.padding_free": True}, needs=_padded),
        Arm("lora", "PEFT (LoRA)", {"techniques.lora.enabled": True}, needs=_module("peft")),
        Arm("qlora", "PEFT (QLoRA, nf4 base)", {"techniques.lora.enabled": True, "techniques.lora.quantize_base": "nf4"},
            needs=_all(_module("peft"), _module("bitsandbytes"), _trained)),
        Arm("offload", "DeepSpeed ZeRO (CPU offload)", {"techniques.offload": "zero2-cpu"},
            needs=_cuda("DeepSpeed ZeRO offload in this benchmark")),
        Arm("best", "Best combination", {}),
        Arm("hf-trainer", "HF Trainer, defaults", {}, kind="hf"),
        Arm("hf-trainer-tuned", "HF Trainer, guide's flags", {}, kind="hf"),
    ]


BEST = {"cpu": ["batch-size", "adamw-fused", "compile"],
        "cuda": ["batch-size", "bf16", "tf32", "flash", "adamw-fused", "compile"]}


def select_arms(b: BenchTrainConfig, device, fmt: str = "text") -> list[Arm]:
    arms = {a.name: a for a in all_arms(b)}
    chosen = [arms[n] for n in arm_names(b)]
    for arm in chosen:
        if arm.name == "best":
            arm.overrides = best_overrides(b, device, arms, fmt)
    return chosen


def arm_names(b: BenchTrainConfig) -> list[str]:
    """The arms asked for, baseline first; an unknown name is an error with a did-you-mean."""
    known = [a.name for a in all_arms(b)]
    names = known if b.bench.arms.strip() == "all" else [n.strip() for n in b.bench.arms.split(",") if n.strip()]
    best = [] if b.bench.best == "auto" else [n.strip() for n in b.bench.best.split(",") if n.strip()]
    for field_name, values in (("arms", names), ("best", best)):
        for n in values:
            if n not in known:
                import difflib

                close = difflib.get_close_matches(n, known, n=1)
                raise ConfigError(f"bench.{field_name}: unknown arm '{n}'.",
                                  hint=f"did you mean '{close[0]}'?" if close else f"choose from: {', '.join(known)}")
    return ["baseline"] + [n for n in dict.fromkeys(names) if n != "baseline"]


def best_overrides(b: BenchTrainConfig, device, arms: dict, fmt: str) -> dict:
    """The recommended methods merged; those this device cannot run are left out (and logged)."""
    names = BEST.get(device.type, BEST["cpu"]) if b.bench.best == "auto" else [n.strip() for n in b.bench.best.split(",")]
    merged = {}
    for n in names:
        if n not in arms or arms[n].kind != "onegpu" or n in ("best", "baseline"):
            raise ConfigError(f"bench.best: '{n}' is not a onegpu method arm.",
                              hint="list method arms, e.g. batch-size,adamw-fused")
        reason = skip_reason(arms[n], device, b, fmt)
        if reason:
            log.info("best: leaving out %s (%s)", n, reason)
            continue
        merged.update(arms[n].overrides)
    return merged


# --------------------------------------------------------------------------------------- configs
def base_config(b: BenchTrainConfig, out_dir: str) -> dict:
    """The run Config (as a dict) every onegpu arm starts from; HF arms mirror its settings. The
    benchmark sets where runs go, the time budget and the logging interval (its timing windows)."""
    cfg = {k: v for k, v in to_dict(b).items() if k != "bench"}
    cfg["output"].update(dir=out_dir, overwrite=True)
    cfg["training"].update(max_minutes=b.bench.max_seconds / 60, log_every=b.bench.warmup_steps)
    return cfg


def apply_overrides(cfg: dict, overrides: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def skip_reason(arm: Arm, device, b: BenchTrainConfig, fmt: str) -> Optional[str]:
    """Why an arm cannot run here (None: it can). Runnable-but-slow arms (bf16 on CPU) still run."""
    if arm.needs is not None:
        return arm.needs(device, b, fmt)
    return None


# ---------------------------------------------------------------------------------------- sweep
def run_sweep(b: BenchTrainConfig, runner: Callable | None = None, progress: Callable | None = None) -> dict:
    """Run every arm `reps` times, interleaved; return the results document (see bench_train_report).
    `progress(doc)` is called after every repetition (a long sweep keeps what it measured)."""
    from onegpu import hardware
    from onegpu.bench import train_report as bench_report

    validate(b)
    device = hardware.detect()
    prep = prepare(b)
    arms = select_arms(b, device, prep["data_format"])
    runner = runner or run_child
    doc = bench_report.new_document(b, device, prep, sys.argv)
    with tempfile.TemporaryDirectory(prefix="onegpu-bench-") as tmp:
        base = base_config(b, tmp)
        for arm in arms:
            reason = skip_reason(arm, device, b, prep["data_format"])
            doc["arms"][arm.name] = {"name": arm.name, "row": arm.row, "kind": arm.kind, "overrides": arm.overrides,
                                     "status": "skipped" if reason else "ok", "reason": reason, "reps": []}
        runnable = [a for a in arms if doc["arms"][a.name]["status"] == "ok"]
        for rep in range(b.bench.reps):
            for arm in runnable:  # interleaved: every arm once per round
                spec = {"arm": arm.name, "kind": arm.kind, "config": apply_overrides(base, arm.overrides),
                        "warmup_steps": b.bench.warmup_steps, "budget_s": b.bench.max_seconds, "rep": rep}
                doc["schedule"].append({"rep": rep, "arm": arm.name, "start": time.time()})
                log.info("rep %d/%d: %s", rep + 1, b.bench.reps, arm.name)
                doc["arms"][arm.name]["reps"].append(runner(spec))
                if progress is not None:
                    progress(doc)
    bench_report.summarize(doc)
    return doc


def validate(b: BenchTrainConfig) -> None:
    """The benchmark's own settings (the run sections are checked as `onegpu train` checks them)."""
    from onegpu.config import validate as validate_run

    validate_run(b)
    for key in ("warmup_steps", "reps"):
        if getattr(b.bench, key) < 1:
            raise ConfigError(f"bench.{key} must be a positive integer, got {getattr(b.bench, key)}.",
                              hint=f"set --bench.{key} >= 1")
    if b.training.max_steps <= b.bench.warmup_steps:
        raise ConfigError(f"training.max_steps ({b.training.max_steps}) must exceed bench.warmup_steps "
                          f"({b.bench.warmup_steps}): nothing would be timed.",
                          hint=f"set --training.max_steps > {b.bench.warmup_steps}")
    if b.bench.max_seconds <= 0:
        raise ConfigError(f"bench.max_seconds must be positive, got {b.bench.max_seconds}.",
                          hint="set --bench.max_seconds 120")
    arm_names(b)


def prepare(b: BenchTrainConfig) -> dict:
    """Tokenize once in the parent (children then read the cache) and size the model's FLOPs."""
    from onegpu import hardware, models
    from onegpu.config import from_dict
    from onegpu.plan.arch import flops_per_token, model_shape
    from onegpu.training import assemble

    with tempfile.TemporaryDirectory(prefix="onegpu-bench-prep-") as tmp:
        cfg = from_dict(base_config(b, tmp))
        device = hardware.detect()
        run = assemble.Run(cfg, device, Path(tmp), models.resolve_name(cfg.model, device.is_gpu), "fp32")
        assemble.build_data(run)
    shape = model_shape(run.model_name, len(run.tokenizer), cfg.model.trust_remote_code)
    return {"data_format": run.data_format, "train_examples": len(run.train_ds), "model_name": run.model_name,
            "params": shape.params, "active_params": shape.active_params,
            "flops_per_token": flops_per_token(shape, b.data.seq_len),
            "peak_flops": hardware.measure_matmul_flops(device.type, seconds=1.0),
            "peak_dtype": "fp32" if device.type == "cpu" else "bf16"}


# --------------------------------------------------------------------------------------- children
def run_child(spec: dict) -> dict:
    """One arm repetition in a fresh interpreter, so its peak memory is its own."""
    with tempfile.TemporaryDirectory(prefix="onegpu-arm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = apply_overrides(spec, {"config.output.dir": tmp})
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "onegpu.bench.train_child", str(spec_path), str(out_path)],
                              capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            log.warning("%s failed: %s", spec["arm"], tail[0])
            return {"status": "failed", "error": tail[0]}
        return json.loads(out_path.read_text())


def run(b: BenchTrainConfig) -> dict[str, Path]:
    """Sweep, then write <out>/<name>.{json,md,png}; returns the paths."""
    from onegpu.bench import train_report as bench_train_report
    from onegpu.hardware import detect

    stem = b.bench.name or f"train-{detect().type}-{time.strftime('%Y%m%d-%H%M')}"
    partial = Path(b.bench.out) / f"{stem}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    doc = run_sweep(b, progress=lambda d: partial.write_text(json.dumps(d, default=str)))
    partial.unlink(missing_ok=True)
    paths = bench_train_report.write_all(doc, b.bench.out, stem)
    print(bench_train_report.markdown(doc))
    return paths


def cli(argv) -> int:
    """`onegpu bench train [--bench.arms a,b] [--bench.reps 3] [--training.max_steps 20] ...`: flags
    generated from BenchTrainConfig (the run sections as in `onegpu train`, plus bench.*)."""
    from onegpu.cli.args import make_parser, parse

    parser = make_parser("onegpu bench train", "Measure the training guide's methods on this device, one arm "
                         "per method, interleaved repetitions, next to HF Trainer.", BenchTrainConfig)
    b, _ = parse(parser, argv, BenchTrainConfig)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "datasets", "urllib3", "filelock", "torch", "torchao"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if b.bench.dry_run:
        return dry_run(b)
    paths = run(b)
    print("results: " + ", ".join(str(p) for p in paths.values()))
    return 0


def dry_run(b: BenchTrainConfig) -> int:
    """Check the settings and print the arms this device would run, with what each overrides and
    why any is skipped; nothing is tokenized or trained."""
    from onegpu.hardware import detect

    validate(b)
    device = detect()
    fmt = "text" if not b.data.path else "unknown"  # the format is only known once the data is read
    print(f"dry run on {device.name}: {b.model.name}, {b.training.micro_batch_size} x {b.training.grad_accum} "
          f"x {b.data.seq_len} tokens, {b.training.max_steps} steps, {b.bench.reps} reps")
    for arm in select_arms(b, device, fmt):
        reason = skip_reason(arm, device, b, fmt)
        what = ", ".join(f"{k}={v}" for k, v in arm.overrides.items()) or ("HF Trainer" if arm.kind == "hf" else "-")
        print(f"  {arm.name:<18} {'skip: ' + reason if reason else what}")
    return 0
