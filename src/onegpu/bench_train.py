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
from typing import Callable, Literal, Optional

from onegpu.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class BenchTrainConfig:
    model: str = "tiny"
    """Model for every arm: a preset (tiny, small, 125m, 1b), a local directory or a Hub id."""
    from_scratch: bool = True
    """Random initialisation of a non-preset model (the speed of a step does not depend on weights)."""
    data: Optional[str] = None
    """Training data (as data.path of `onegpu train`). Default: the Python standard library source."""
    max_bytes: int = 1_000_000
    """Bytes of the default corpus to read (keeps tokenization short)."""
    seq_len: int = 256
    """Tokens per sequence."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass of the baseline arm."""
    grad_accum: int = 2
    """Micro-batches per optimizer step of the baseline arm (effective batch = the product, kept by every arm)."""
    steps: int = 10
    """Optimizer steps per arm and repetition."""
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
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Baseline compute precision (auto: fp32 on CPU, bf16/fp16 on a GPU)."""
    out: str = "benchmarks/results"
    """Folder for the results (json, md, png)."""
    name: Optional[str] = None
    """File stem of the results (default: train-<device>-<date>)."""
    seed: int = 1234
    """Seed for model init and data order (the same in every arm)."""


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

    if is_preset(b.model) or b.from_scratch:
        return "QLoRA quantizes a trained model: give --model a saved model directory (and --from_scratch false)"
    return None


def _padded(dev, b, fmt):
    return None if fmt != "text" else "text data is packed into full blocks already: no padding to remove"


def all_arms(b: BenchTrainConfig) -> list[Arm]:
    """The guide's rows, one setting each; the baseline first, HF Trainer last."""
    eff = b.micro_batch_size * b.grad_accum
    small = max(1, b.micro_batch_size // 4)
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
    names = known if b.arms.strip() == "all" else [n.strip() for n in b.arms.split(",") if n.strip()]
    best = [] if b.best == "auto" else [n.strip() for n in b.best.split(",") if n.strip()]
    for field_name, values in (("arms", names), ("best", best)):
        for n in values:
            if n not in known:
                import difflib

                close = difflib.get_close_matches(n, known, n=1)
                raise ConfigError(f"{field_name}: unknown arm '{n}'.",
                                  hint=f"did you mean '{close[0]}'?" if close else f"choose from: {', '.join(known)}")
    return ["baseline"] + [n for n in dict.fromkeys(names) if n != "baseline"]


def best_overrides(b: BenchTrainConfig, device, arms: dict, fmt: str) -> dict:
    """The recommended methods merged; those this device cannot run are left out (and logged)."""
    names = BEST.get(device.type, BEST["cpu"]) if b.best == "auto" else [n.strip() for n in b.best.split(",")]
    merged = {}
    for n in names:
        if n not in arms or arms[n].kind != "onegpu" or n in ("best", "baseline"):
            raise ConfigError(f"best: '{n}' is not a onegpu method arm.", hint="list method arms, e.g. batch-size,adamw-fused")
        reason = skip_reason(arms[n], device, b, fmt)
        if reason:
            log.info("best: leaving out %s (%s)", n, reason)
            continue
        merged.update(arms[n].overrides)
    return merged


# --------------------------------------------------------------------------------------- configs
def base_config(b: BenchTrainConfig, out_dir: str) -> dict:
    """The run Config (as a dict) every onegpu arm starts from; HF arms mirror its settings.

    No learning-rate warm-up: HF's schedule starts warm-up at lr 0 and ours at lr/warmup, and
    without it both are the same cosine, so the final losses are comparable."""
    return {
        "model": {"name": b.model, "from_scratch": b.from_scratch},
        "data": {"path": b.data, "seq_len": b.seq_len, "max_bytes": b.max_bytes, "num_proc": 1},
        "training": {"micro_batch_size": b.micro_batch_size, "grad_accum": b.grad_accum, "max_steps": b.steps,
                     "max_minutes": b.max_seconds / 60, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1,
                     "log_every": b.warmup_steps, "seed": b.seed},
        "techniques": {"precision": b.precision},
        "output": {"dir": out_dir, "overwrite": True, "tensorboard": False},
    }


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
    from onegpu import bench_train_report as bench_report, hardware

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
        for rep in range(b.reps):
            for arm in runnable:  # interleaved: every arm once per round
                spec = {"arm": arm.name, "kind": arm.kind, "config": apply_overrides(base, arm.overrides),
                        "warmup_steps": b.warmup_steps, "budget_s": b.max_seconds, "rep": rep}
                doc["schedule"].append({"rep": rep, "arm": arm.name, "start": time.time()})
                log.info("rep %d/%d: %s", rep + 1, b.reps, arm.name)
                doc["arms"][arm.name]["reps"].append(runner(spec))
                if progress is not None:
                    progress(doc)
    bench_report.summarize(doc)
    return doc


def validate(b: BenchTrainConfig) -> None:
    for key in ("seq_len", "micro_batch_size", "grad_accum", "steps", "warmup_steps", "reps"):
        if getattr(b, key) < 1:
            raise ConfigError(f"{key} must be a positive integer, got {getattr(b, key)}.", hint=f"set --{key} >= 1")
    if b.steps <= b.warmup_steps:
        raise ConfigError(f"steps ({b.steps}) must exceed warmup_steps ({b.warmup_steps}): nothing would be timed.",
                          hint=f"set --steps > {b.warmup_steps}")
    if b.max_seconds <= 0:
        raise ConfigError(f"max_seconds must be positive, got {b.max_seconds}.", hint="set --max_seconds 120")
    arm_names(b)


def prepare(b: BenchTrainConfig) -> dict:
    """Tokenize once in the parent (children then read the cache) and size the model's FLOPs."""
    from onegpu import assemble, hardware, models
    from onegpu.config import from_dict

    with tempfile.TemporaryDirectory(prefix="onegpu-bench-prep-") as tmp:
        cfg = from_dict(base_config(b, tmp))
        device = hardware.detect()
        run = assemble.Run(cfg, device, Path(tmp), models.resolve_name(cfg.model, device.is_gpu), "fp32")
        assemble.build_data(run)
        n_params, n_matmul, layers, hidden = model_size(run)
    return {"data_format": run.extras["data_format"], "train_examples": len(run.train_ds),
            "model_name": run.model_name, "params": n_params, "matmul_params": n_matmul,
            "flops_per_token": flops_per_token(n_matmul, layers, hidden, b.seq_len),
            "peak_flops": measure_peak_flops(device), "peak_dtype": "fp32" if device.type == "cpu" else "bf16"}


def model_size(run) -> tuple[int, int, int, int]:
    """Parameters (total, in matmuls) without allocating them: the model is built on the meta device."""
    import torch

    from onegpu import models

    with torch.device("meta"):
        model = models.load_model(run.model_name, run.cfg.model, run.tokenizer) if models.is_preset(run.model_name) \
            else _meta_from_config(run)
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    return total, matmul, c.num_hidden_layers, c.hidden_size


def _meta_from_config(run):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(run.model_name, trust_remote_code=run.cfg.model.trust_remote_code)
    return AutoModelForCausalLM.from_config(config)


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward 2N, backward 4N) plus the
    attention score/value matmuls, 12·L·d·T (PaLM appendix B; causal masking not discounted)."""
    return 6.0 * matmul_params + 12.0 * layers * hidden * seq_len


def measure_peak_flops(device, seconds: float = 1.0) -> float:
    """Best dense-matmul throughput seen: fp32 on CPU, bf16 on a GPU (the denominator of MFU)."""
    import torch

    on_gpu = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if on_gpu else (1024, torch.float32)
    dev = "cuda" if on_gpu else "cpu"
    a, c = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ c
        if on_gpu:
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


# --------------------------------------------------------------------------------------- children
def run_child(spec: dict) -> dict:
    """One arm repetition in a fresh interpreter, so its peak memory is its own."""
    with tempfile.TemporaryDirectory(prefix="onegpu-arm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = apply_overrides(spec, {"config.output.dir": tmp})
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "onegpu.bench_train_child", str(spec_path), str(out_path)],
                              capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            log.warning("%s failed: %s", spec["arm"], tail[0])
            return {"status": "failed", "error": tail[0]}
        return json.loads(out_path.read_text())


def run(b: BenchTrainConfig) -> dict[str, Path]:
    """Sweep, then write <out>/<name>.{json,md,png}; returns the paths."""
    from onegpu import bench_train_report
    from onegpu.hardware import detect

    stem = b.name or f"train-{detect().type}-{time.strftime('%Y%m%d-%H%M')}"
    partial = Path(b.out) / f"{stem}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    doc = run_sweep(b, progress=lambda d: partial.write_text(json.dumps(d, default=str)))
    partial.unlink(missing_ok=True)
    paths = bench_train_report.write_all(doc, b.out, stem)
    print(bench_train_report.markdown(doc))
    return paths


def cli(argv) -> int:
    """`onegpu bench train [--arms a,b] [--reps 3] ...`: flags generated from BenchTrainConfig."""
    from onegpu.cliargs import make_parser, parse

    parser = make_parser("onegpu bench train", "Measure the training guide's methods on this device, one arm "
                         "per method, interleaved repetitions, next to HF Trainer.", BenchTrainConfig)
    b, _ = parse(parser, argv, BenchTrainConfig)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "datasets", "urllib3", "filelock", "torch", "torchao"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    paths = run(b)
    print("results: " + ", ".join(str(p) for p in paths.values()))
    return 0
