"""The committed training benchmarks, one preset each (extra flags go to `onegpu bench train`).

    python benchmarks/bench_train.py cpu --snapshot       # the CPU table in benchmarks/results/
    python benchmarks/bench_train.py headline --snapshot  # onegpu vs HF Trainer only, more reps
    python benchmarks/bench_train.py cpu-dpo --snapshot   # DPO: onegpu vs TRL's DPOTrainer (CPU)
    python benchmarks/bench_train.py cpu-grpo --snapshot  # GRPO: onegpu vs TRL's GRPOTrainer (CPU)
    python benchmarks/bench_train.py cpu-kto cpu-kto-small --snapshot        # KTO vs KTOTrainer
    python benchmarks/bench_train.py cpu-reward cpu-reward-small --snapshot  # vs RewardTrainer
    python benchmarks/bench_train.py gpu-grpo             # the same GRPO comparison on a CUDA GPU
    python benchmarks/bench_train.py gpu-quick            # on a CUDA GPU: one preset (below)
    python benchmarks/bench_train.py gpu-quick gpu-best   # several presets, one after the other
    python benchmarks/bench_train.py gpu                  # every GPU preset (~73 minutes)
    python benchmarks/bench_train.py gpu --dry-run        # list each preset's arms, train nothing

Options: --snapshot (run from a copy of src/, below), --dry-run (check the settings and list the
arms, without writing the model or training), --workdir DIR (where the GPU presets keep the saved
model and the chat data, and cpu-grpo the default job's run it trains from; default
$ONEGPU_BENCH_WORKDIR, else <tmp>/onegpu-bench-work).

GPU presets (Llama ~1B, bf16, seq 2048; `gpu` runs the ten of them, `gpu-methods` gpu-memory ..
gpu-offload; gpu-fp8, gpu-fp8-3b and gpu-grpo are apart): their arms, sizes and estimated minutes
are tabled in benchmarks/README.md ("GPU presets"). The model is written once into --workdir with
save_pretrained and every arm of every preset loads it from there; each preset fits one 10-minute
command. On a GPU every onegpu arm compiles as a default run of 50+ steps does (bench/settle.py).

--snapshot runs every arm from a copy of src/ taken at the start, so edits made in the checkout
while a long sweep runs cannot change the code half-way through; the results record the commit
(marked "+local" when the copy had uncommitted edits).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the presets' flags, beside this script

from train_flags import (  # noqa: E402
    CPU,
    CPU_DPO,
    CPU_GRPO,
    CPU_UNPAIRED,
    GPU,
    GPU_3B,
    HEADLINE,
)


@dataclass(frozen=True)
class Preset:
    name: str
    args: tuple[str, ...]  # flags of `onegpu bench train`
    arms: tuple[str, ...] = ()  # besides the baseline; () = every arm
    gpu: bool = False  # trains the saved Llama ~1B
    chat: bool = False  # on the chat data set (variable lengths) instead of packed text
    sft_model: bool = False  # starts from the default job's trained model (GRPO)
    saved: str = ""  # a preset model written once and trained (gpu=True: the 1b), e.g. "3b"
    threads: int = 0  # OMP_NUM_THREADS of the sweep and its arms (0: torch's default)

    def argv(self) -> list[str]:
        return list(self.args) + (
            ["--bench.arms", ",".join(("baseline",) + self.arms)] if self.arms else []
        )


PRESETS = {
    p.name: p
    for p in [
        Preset("cpu", CPU),
        Preset("headline", HEADLINE, ("plain-loss", "hf-trainer", "hf-trainer-tuned")),
        Preset("cpu-dpo", CPU_DPO),
        Preset("cpu-grpo", CPU_GRPO, sft_model=True),
        # KTO and reward models vs TRL, on the tiny and small presets (1.1 M and 29 M
        # parameters), the LoRA arms left out; the small shape's steps are ~20x the tiny one's, so
        # it runs 6 (2 untimed), with 15 minutes an arm (300 s gave no timed step on the shared
        # CPU at load ~19)
        *(
            Preset(
                f"cpu-{objective}{suffix}",
                CPU_UNPAIRED + ("--training.objective", objective, "--model.name", model) + extra,
                (f"trl-{objective}",),
                threads=1,
            )
            for objective in ("kto", "reward")
            for suffix, model, extra in (
                ("", "tiny", ()),
                (
                    "-small",
                    "small",
                    ("--training.max_steps", "6", "--bench.warmup_steps", "2")
                    + ("--bench.max_seconds", "900"),
                ),
            )
        ),
        # the same on a CUDA GPU (scripts/gpu_check.sh grpo): 2 rounds fit one 10-minute command
        Preset(
            "gpu-grpo",
            CPU_GRPO + ("--bench.reps", "2", "--bench.max_seconds", "150"),
            sft_model=True,
        ),
        Preset("gpu-quick", GPU, ("hf-trainer-tuned", "trl-sft"), gpu=True),
        Preset("gpu-best", GPU, ("best", "hf-trainer"), gpu=True),
        Preset("gpu-memory", GPU, ("batch-size", "grad-accum", "checkpointing"), gpu=True),
        Preset("gpu-precision", GPU, ("fp32", "fp32-tf32", "fp16"), gpu=True),
        Preset("gpu-kernels", GPU, ("flash", "eager"), gpu=True),
        Preset("gpu-optim", GPU, ("adamw-fused", "adafactor", "adamw-8bit"), gpu=True),
        Preset("gpu-offload", GPU, ("offload", "preload"), gpu=True),
        Preset("gpu-peft", GPU, ("lora", "qlora", "plain-loss"), gpu=True),
        Preset("gpu-chat", GPU, ("padding-free", "hf-trainer", "trl-sft"), gpu=True, chat=True),
        # FP8 (not in `gpu`: scripts/gpu_check.sh fp8 / fp8-3b): bf16 compiled (the baseline),
        # FP8 compiled and HF Trainer with the guide's flags, interleaved; then the 3B shape
        Preset("gpu-fp8", GPU, ("fp8", "hf-trainer-tuned"), saved="1b"),
        Preset("gpu-fp8-3b", GPU_3B, ("fp8",), saved="3b"),
        # DPO on the corpus pairs (short: seq_len is only the cap); ref-copy left out to fit 10
        # minutes
        Preset(
            "gpu-dpo",
            GPU + ("--training.objective", "dpo"),
            ("lora", "trl-dpo", "trl-dpo-lora"),
            gpu=True,
        ),
    ]
}
GROUPS = {
    "gpu-methods": ["gpu-memory", "gpu-precision", "gpu-kernels", "gpu-optim", "gpu-offload"],
    "gpu": [n for n, p in PRESETS.items() if p.gpu],
}

# Estimated seconds of one repetition of each arm at the GPU presets' shape on an H100 (not
# measured): ~30 s to start a process and load the model, 20 micro-steps of 4 x 2048 tokens at
# ~0.45 s in bf16, ~10 s for our loop to write its final 4 GB model, ~60 s to compile; fp32 ~3.3x
# the step time, TF32 ~1.6x, checkpointing ~1.3x; offload builds DeepSpeed's CPU Adam once (~90 s)
# and steps it on the CPU. The peers write no model. Our arms compile on a GPU (bench/settle.py):
# regional compile added ~11 s to an arm's process on the H100 (train-gpu-best-20261125: compile arm
# 25.6 s, baseline 14.7 s), and these estimates were above every measured preset there (gpu-quick:
# 5.1 min measured, model included, against 7.75 estimated), so they stand as they were. DPO's
# pairs are short (~100-300 tokens); TRL loads its reference copy from disk (~10 s) and runs it
# every step.
_ARMS = """
baseline=50 batch-size=50 grad-accum=55 checkpointing=55 fp32=70 fp32-tf32=55 fp16=50 bf16=50
tf32=50 flash=50 compile=110 eager=50 plain-loss=50 adamw-fused=50 adafactor=50 adamw-8bit=50
preload=50 offload=105 lora=45 qlora=55 padding-free=45 fp8=110 best=110 hf-trainer=60
hf-trainer-tuned=100 trl-sft=45 ref-copy=55 trl-dpo=60 trl-dpo-lora=50
"""
ARM_SECONDS = {arm: int(sec) for arm, sec in (item.split("=") for item in _ARMS.split())}
SETUP_SECONDS = 30  # the parent: imports, tokenizing (cached after the first preset), the peak


def estimate_seconds(preset: Preset) -> float:
    """One GPU preset's minutes on an H100, from ARM_SECONDS (the one-off model and chat data
    excluded)."""
    reps = int(preset.args[preset.args.index("--bench.reps") + 1])
    return SETUP_SECONDS + reps * sum(ARM_SECONDS[a] for a in ("baseline",) + preset.arms)


def chat_data(path: Path, limit: int = 20000) -> Path:
    """Chat records of very different lengths (so padding matters): a question about a standard
    library function, answered with its docstring. Written once; a killed write leaves no file."""
    if path.is_file():
        return path
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for src in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(src.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            doc = (
                ast.get_docstring(node)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                else None
            )
            if doc and len(doc) > 40:
                rows.append(
                    {
                        "messages": [
                            {"role": "user", "content": f"What does {src.stem}.{node.name} do?"},
                            {"role": "assistant", "content": doc},
                        ]
                    }
                )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]), encoding="utf-8")
    os.replace(tmp, path)
    return path


def saved_model(path: Path, preset: str = "1b", max_bytes: int = 3_000_000) -> Path:
    """A randomly initialised preset written with save_pretrained (with its locally trained
    tokenizer), so that every arm — QLoRA included, which quantizes a saved model — loads the
    same weights through from_pretrained. Step speed does not depend on the weights' values.
    Written once per folder, into a temporary name renamed at the end, so a killed write is never
    mistaken for a model by the next preset."""
    from onegpu import models
    from onegpu.config import from_dict
    from onegpu.training.data import build_data

    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = from_dict({"model": {"name": preset}, "data": {"max_bytes": max_bytes}})
    tokenizer = build_data(cfg, preset).tokenizer
    models.load_model(preset, cfg.model, tokenizer).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, path)
    return path


def default_model(runs: Path) -> Path:
    """The default job's trained model (the newest default run's final/ under ``runs``), trained
    first (`onegpu train`, ~2 minutes on a CPU) when there is none: the model the default GRPO job
    starts from."""
    from onegpu.training.rl_default import newest_default_final

    final = newest_default_final(runs)
    if final is None:
        cmd = [sys.executable, "-m", "onegpu.cli.main", "train", "--output.dir", str(runs)]
        print("+", " ".join(cmd[2:] + ["--output.report_to", "none"]), flush=True)
        subprocess.run(cmd + ["--output.report_to", "none"], cwd=ROOT, check=True)
        final = newest_default_final(runs)
    return final


def snapshot_env(tmp: str) -> dict:
    """PYTHONPATH pointing at a copy of src/ taken now, and the commit it was taken from (with
    "+local" when the checkout had uncommitted edits) for the results."""
    git = lambda *a: subprocess.run(  # noqa: E731
        ["git", *a], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") + (
        "+local" if git("status", "--porcelain", "--untracked-files=no", "src") else ""
    )
    shutil.copytree(
        ROOT / "src", Path(tmp) / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    return {**os.environ, "PYTHONPATH": str(Path(tmp) / "src"), "ONEGPU_BENCH_COMMIT": commit}


def bench(args: list[str], env: dict | None, dry_run: bool, threads: int = 0) -> int:
    # a dry run in this process: every preset's check takes a fraction of a second after the first
    if dry_run:
        from onegpu.cli.main import main as onegpu_main

        return onegpu_main(["bench", "train", *args, "--bench.dry_run", "true"])
    cmd = [sys.executable, "-m", "onegpu.cli.main", "bench", "train", *args]
    if threads:  # the arms are children of this command: they inherit it
        env = {**(env or os.environ), "OMP_NUM_THREADS": str(threads)}
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    print("+ " + prefix + " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def preset_argv(preset: Preset, workdir: Path, stamp: str, dry_run: bool) -> list[str]:
    """The preset's flags, with the saved model and chat data it trains on (their paths only, in a
    dry run)."""
    argv = preset.argv()
    if preset.gpu or preset.saved:
        kind = preset.saved or "1b"
        model = workdir / f"llama-{kind}"
        max_bytes = int(argv[argv.index("--data.max_bytes") + 1])
        argv += [
            "--model.name",
            str(model if dry_run else saved_model(model, kind, max_bytes=max_bytes)),
            "--model.from_scratch",
            "false",
        ]
    if preset.sft_model:
        runs = workdir / "runs"
        argv += [
            "--model.name",
            str(runs / "<default run>/final" if dry_run else default_model(runs)),
        ]
    if preset.chat:
        chat = workdir / "chat.jsonl"
        argv += ["--data.path", str(chat if dry_run else chat_data(chat))]
    name = {
        "cpu": f"train-cpu-{stamp}",
        "headline": f"train-cpu-{stamp}-vs-hf",
        "cpu-dpo": f"train-cpu-dpo-{stamp}",
        "cpu-grpo": f"train-cpu-grpo-{stamp}",
    }.get(preset.name, f"train-{preset.name}-{stamp}" if preset.name.startswith("cpu-") else None)
    return argv + [
        "--bench.out",
        str(RESULTS),
        "--bench.name",
        name or f"train-{preset.name}-{stamp}",
    ]


def parse(argv: list[str]) -> tuple[list[Preset], dict, list[str]]:
    """Leading preset names (or groups), then this script's options; the rest goes to `onegpu bench
    train`."""
    names: list[str] = []
    while argv and (argv[0] in PRESETS or argv[0] in GROUPS):
        names += GROUPS.get(argv[0], [argv[0]])
        argv = argv[1:]
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--snapshot", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    default = Path(tempfile.gettempdir()) / "onegpu-bench-work"
    ap.add_argument("--workdir", default=os.environ.get("ONEGPU_BENCH_WORKDIR") or str(default))
    opts, extra = ap.parse_known_args(argv)
    return [PRESETS[n] for n in dict.fromkeys(names)], vars(opts), extra


def main(argv: list[str]) -> int:
    presets, opts, extra = parse(list(argv))
    if not presets:
        print(__doc__)
        if argv and not argv[0].startswith("-"):
            print(
                f"unknown preset '{argv[0]}'; choose from: {', '.join([*PRESETS, *GROUPS])}",
                file=sys.stderr,
            )
        return 2
    stamp, rc = time.strftime("%Y%m%d"), 0
    workdir = Path(opts["workdir"])
    with tempfile.TemporaryDirectory(prefix="onegpu-snapshot-") as tmp:
        env = snapshot_env(tmp) if opts["snapshot"] else None
        for preset in presets:
            est = (
                f"; estimated {estimate_seconds(preset) / 60:.1f} min on an H100"
                if preset.gpu
                else ""
            )
            print(
                f"== preset {preset.name}: {', '.join(preset.arms) or 'every arm'}{est}", flush=True
            )
            # One preset failing (an out-of-memory, a missing wheel) does not stop the ones after
            # it.
            rc = max(
                rc,
                bench(
                    preset_argv(preset, workdir, stamp, opts["dry_run"]) + extra,
                    env,
                    opts["dry_run"],
                    preset.threads,
                ),
            )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
