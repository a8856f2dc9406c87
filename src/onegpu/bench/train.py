"""`onegpu bench train`: the guide's technique table, measured on this machine, next to HF Trainer
and TRL's SFTTrainer; with `--objective dpo`, DPO next to TRL's DPOTrainer (arms.dpo_arms); with
`--objective grpo`, GRPO next to TRL's GRPOTrainer (arms.grpo_arms, train_grpo.py); with
`--objective kto` / `reward`, KTO / a reward model next to TRL's KTOTrainer / RewardTrainer
(arms.unpaired_arms, train_trl.py).

Every arm (arms.py) is one setting of the run ``Config`` (so methods show up here as soon as they
exist), trained for the same steps on the same tokenized data and effective batch. Arms run in a
fresh subprocess each (clean peak memory) and repetitions are interleaved — A, B, C, A, B, C — so
slow drift of a shared machine hits every arm alike. Every ratio in the report comes from one run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from onegpu.bench.arms import arm_names, select_arms, skip_reason
from onegpu.bench.settings import BenchSettings, BenchTrainConfig
from onegpu.bench.settle import apply_overrides, settle_compile
from onegpu.bench.train_child import TRL
from onegpu.config import to_dict
from onegpu.errors import ConfigError

__all__ = ["BenchSettings", "BenchTrainConfig", "run_sweep", "run", "cli", "validate", "dry_run"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- configs
def base_config(b: BenchTrainConfig, out_dir: str) -> dict:
    """The run Config (as a dict) every onegpu arm starts from; HF arms mirror its settings. The
    benchmark sets where runs go, the time budget and the logging interval (its timing windows)."""
    from onegpu.hyper import resolve_hyperparameters

    # settled once here, so every arm and the HF peers train with the same numbers
    cfg = {k: v for k, v in to_dict(resolve_hyperparameters(b)).items() if k != "bench"}
    cfg["output"].update(dir=out_dir, overwrite=True)
    cfg["training"].update(max_minutes=b.bench.max_seconds / 60, log_every=b.bench.warmup_steps)
    if b.training.objective == "grpo":  # the reward curve and each step's figures: every step
        cfg["training"]["log_every"] = 1
    return cfg


# ---------------------------------------------------------------------------------------- sweep
def run_sweep(
    b: BenchTrainConfig, runner: Callable | None = None, progress: Callable | None = None
) -> dict:
    """Run every arm `reps` times, interleaved; return the results document (see
    bench_train_report). `progress(doc)` is called after every repetition (a long sweep keeps what
    it measured)."""
    from onegpu import hardware
    from onegpu.bench import provenance
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
            doc["arms"][arm.name] = {
                "name": arm.name,
                "row": arm.row,
                "kind": arm.kind,
                "overrides": arm.overrides,
                "status": "skipped" if reason else "ok",
                "reason": reason,
                "reps": [],
            }
        runnable = [a for a in arms if doc["arms"][a.name]["status"] == "ok"]
        for rep in range(b.bench.reps):
            for arm in runnable:  # interleaved: every arm once per round
                spec = {
                    "arm": arm.name,
                    "kind": arm.kind,
                    "config": arm_config(arm, base, b, rep, device.type),
                    "warmup_steps": b.bench.warmup_steps,
                    "budget_s": b.bench.max_seconds,
                    "rep": rep,
                }
                doc["schedule"].append(
                    {"rep": rep, "arm": arm.name, "start": time.time(), "load": _load()}
                )
                log.info("rep %d/%d: %s", rep + 1, b.bench.reps, arm.name)
                doc["arms"][arm.name]["reps"].append(runner(spec))
                if progress is not None:
                    progress(doc)
    doc["uptime_after"] = provenance.uptime()  # the header's load after (provenance.end)
    bench_report.summarize(doc)
    return doc


def arm_config(arm, base: dict, b: BenchTrainConfig, rep: int, device_type: str) -> dict:
    """The run Config of one arm's repetition: the base with the arm's overrides, and for our own
    arms compile=auto settled as a run of realistic length settles it (arms.settle_compile)."""
    config = apply_overrides(base, {**arm.overrides, **round_seed(b, rep)})
    return settle_compile(config, device_type) if arm.kind == "onegpu" else config


def _load() -> list[float] | None:
    """The machine's load average (1, 5, 15 minutes, as `uptime` shows it): on a shared machine
    it says how much else was running."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def round_seed(b: BenchTrainConfig, rep: int) -> dict:
    """GRPO samples its completions: with one seed every round would repeat the same rollouts and
    reward curve, so each round has its own seed (the same for every arm of the round: the same
    prompts in the same order), and the spread over rounds is the reward's noise."""
    if b.training.objective != "grpo":
        return {}
    return {"training.seed": b.training.seed + rep}


def validate(b: BenchTrainConfig) -> None:
    """The benchmark's own settings (the run sections are checked as `onegpu train` checks them)."""
    from onegpu.config import validate as validate_run

    validate_run(b)
    if b.training.objective not in ("sft", "dpo", "grpo", "kto", "reward"):
        raise ConfigError(
            f"bench train measures training.objective sft, dpo, grpo, kto or reward, not "
            f"{b.training.objective}.",
            hint="use --objective dpo, grpo, kto, reward or sft; orpo and simpo have no peer "
            "trainer here",
        )
    for key in ("warmup_steps", "reps"):
        if getattr(b.bench, key) < 1:
            raise ConfigError(
                f"bench.{key} must be a positive integer, got {getattr(b.bench, key)}.",
                hint=f"set --bench.{key} >= 1",
            )
    if b.training.max_steps <= b.bench.warmup_steps:
        raise ConfigError(
            f"training.max_steps ({b.training.max_steps}) must exceed bench.warmup_steps "
            f"({b.bench.warmup_steps}): nothing would be timed.",
            hint=f"set --training.max_steps > {b.bench.warmup_steps}",
        )
    for key, ok, want, fix in (
        ("max_micro_batch", b.bench.max_micro_batch >= 0, "0 (no limit) or positive", 8),
        ("max_seconds", b.bench.max_seconds > 0, "positive", 120),
    ):
        if not ok:
            raise ConfigError(
                f"bench.{key} must be {want}, got {getattr(b.bench, key)}.",
                hint=f"set --bench.{key} {fix}",
            )
    arm_names(b)


def prepare(b: BenchTrainConfig) -> dict:
    """Tokenize once in the parent (children then read the cache) and size the model's FLOPs."""
    from onegpu import hardware, models
    from onegpu.config import from_dict
    from onegpu.plan.arch import flops_per_token, model_shape
    from onegpu.training.data import build_data

    with tempfile.TemporaryDirectory(prefix="onegpu-bench-prep-") as tmp:
        cfg = from_dict(base_config(b, tmp))
        device = hardware.detect()
        name = models.resolve_name(cfg.model, device.is_gpu)
        data = build_data(cfg, name)
    shape = model_shape(name, len(data.tokenizer), cfg.model.trust_remote_code)
    return {
        "data_format": data.format,
        "train_examples": len(data.train_ds),
        "model_name": name,
        "params": shape.params,
        "active_params": shape.active_params,
        "flops_per_token": flops_per_token(shape, b.data.seq_len),
        "peak_flops": hardware.measure_matmul_flops(device.type, seconds=1.0),
        "peak_dtype": "fp32" if device.type == "cpu" else "bf16",
    }


# --------------------------------------------------------------------------------------- children
def run_child(spec: dict) -> dict:
    """One arm repetition in a fresh interpreter, so its peak memory is its own."""
    with tempfile.TemporaryDirectory(prefix="onegpu-arm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = apply_overrides(spec, {"config.output.dir": tmp})
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "onegpu.bench.train_child", str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
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

    parser = make_parser(
        "onegpu bench train",
        "Measure the training guide's methods on this device, one arm "
        "per method, interleaved repetitions, next to HF Trainer.",
        BenchTrainConfig,
    )
    b, _ = parse(parser, objective_shorthand(argv), BenchTrainConfig)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "datasets", "urllib3", "filelock", "torch", "torchao"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if b.bench.dry_run:
        return dry_run(b)
    paths = run(b)
    print("results: " + ", ".join(str(p) for p in paths.values()))
    return 0


def objective_shorthand(argv) -> list[str]:
    """`--objective dpo` means `--training.objective dpo`: the objective picks the whole arm table,
    so it gets a short flag of its own."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--objective":
            out[i] = "--training.objective"
        elif arg.startswith("--objective="):
            out[i] = "--training.objective=" + arg.split("=", 1)[1]
    return out


def dry_run(b: BenchTrainConfig) -> int:
    """Check the settings and print the arms this device would run, with what each overrides and
    why any is skipped; nothing is tokenized or trained."""
    from onegpu.hardware import detect

    validate(b)
    device = detect()
    formats = {"sft": "text", "grpo": "prompt", "kto": "unpaired"}
    # a data file's format is known once read
    fmt = "unknown" if b.data.path else formats.get(b.training.objective, "preference")
    print(
        f"dry run on {device.name}: {b.model.name}, {b.training.micro_batch_size} x "
        f"{b.training.grad_accum} x {b.data.seq_len} tokens, {b.training.max_steps} steps, "
        f"{b.bench.reps} reps"
        + (f" [{b.bench.name}]" if b.bench.name else "")
        + (f"; objective {b.training.objective}" if b.training.objective != "sft" else "")
    )
    peers = {"hf": "HF Trainer", **{k: f"TRL {v}Trainer" for k, v in TRL.items()}}
    for arm in select_arms(b, device, fmt):
        reason = skip_reason(arm, device, b, fmt)
        what = ", ".join(f"{k}={v}" for k, v in arm.overrides.items())
        if arm.kind in peers:  # a peer with settings of its own (LoRA) names both
            what = peers[arm.kind] + (f" ({what})" if what else "")
        what = (what or "-") + settled_note(arm, b, device.type)
        print(f"  {arm.name:<18} {'skip: ' + reason if reason else what}")
    return 0


def settled_note(arm, b: BenchTrainConfig, device_type: str) -> str:
    """What settle_compile adds to one of our arms on this device, for the dry run's listing."""
    if arm.kind != "onegpu":
        return ""
    config = apply_overrides({k: v for k, v in to_dict(b).items() if k != "bench"}, arm.overrides)
    mode = settle_compile(config, device_type)["techniques"]["compile"]
    if mode == config["techniques"]["compile"]:
        return ""
    return f" [compile {mode}: as a default run of 50+ steps]"
