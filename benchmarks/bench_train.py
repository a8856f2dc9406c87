"""The committed training benchmarks, one command each (extra flags go to `onegpu bench train`).

    python benchmarks/bench_train.py cpu --snapshot       # the CPU table in benchmarks/results/
    python benchmarks/bench_train.py headline --snapshot  # onegpu vs HF Trainer only, more repetitions
    python benchmarks/bench_train.py gpu                  # on a CUDA GPU: Llama ~1B, bf16, seq 2048

`gpu` saves a randomly initialised Llama ~1B (`1b` preset; no download) and runs two sweeps on
it: every method on packed text (full fine-tuning, LoRA, QLoRA, and the rest), then padded vs
packed (padding-free) chat data, with LoRA and QLoRA, on a chat set written from the standard
library's docstrings.

--snapshot runs every arm from a copy of src/ taken at the start, so edits made in the checkout
while a long sweep runs cannot change the code half-way through; the results record the commit
(marked "+local" when the copy had uncommitted edits).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# The default job's tokens per step (tiny preset, 16 x 256), split 8 x 2 so that the batch-size
# arm (16 x 1) and the accumulation arm (2 x 8) each change something. 24 steps keep the sweep near
# 20 minutes; that is too short for techniques.compile=auto, so the baseline here runs uncompiled
# and the compile arm shows what compiling adds.
CPU = ["--model.name", "tiny", "--data.seq_len", "256", "--training.micro_batch_size", "8", "--training.grad_accum", "2", "--training.max_steps", "24",
       "--bench.warmup_steps", "4", "--bench.reps", "3", "--bench.max_seconds", "150"]
# The default job's shape (tiny preset, 16 x 256 tokens a step), long enough (60 steps) that
# techniques.compile=auto compiles, as it does in the default run; compiling falls in the 10 untimed steps.
HEADLINE = ["--model.name", "tiny", "--data.seq_len", "256", "--training.micro_batch_size", "16", "--training.grad_accum", "1", "--training.max_steps", "60",
            "--bench.warmup_steps", "10", "--bench.reps", "4", "--bench.max_seconds", "240",
            "--bench.arms", "baseline,plain-loss,hf-trainer,hf-trainer-tuned"]
GPU = ["--model.name", "1b", "--data.seq_len", "2048", "--training.micro_batch_size", "4", "--training.grad_accum", "4", "--training.max_steps", "20",
       "--bench.warmup_steps", "5", "--bench.reps", "3", "--bench.max_seconds", "300", "--techniques.precision", "bf16", "--data.max_bytes", "6000000"]
GPU_CHAT_ARMS = "baseline,padding-free,lora,qlora,hf-trainer,hf-trainer-tuned"


def chat_data(path: Path, limit: int = 20000) -> Path:
    """Chat records of very different lengths (so padding matters): a question about a standard
    library function, answered with its docstring."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for src in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(src.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if doc and len(doc) > 40:
                rows.append({"messages": [{"role": "user", "content": f"What does {src.stem}.{node.name} do?"},
                                          {"role": "assistant", "content": doc}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]), encoding="utf-8")
    return path


def saved_model(path: Path, preset: str = "1b", max_bytes: int = 6_000_000) -> Path:
    """A randomly initialised preset written with save_pretrained (with its locally trained
    tokenizer), so that every arm — QLoRA included, which quantizes a saved model — loads the
    same weights through from_pretrained. Step speed does not depend on the weights' values."""
    from onegpu import hardware, models
    from onegpu.training import assemble
    from onegpu.config import from_dict

    if (path / "config.json").is_file():
        return path
    cfg = from_dict({"model": {"name": preset}, "data": {"max_bytes": max_bytes}})
    run = assemble.Run(cfg, hardware.detect(), path, preset, "fp32")
    assemble.build_data(run)
    models.load_model(preset, cfg.model, run.tokenizer).save_pretrained(str(path))
    run.tokenizer.save_pretrained(str(path))
    return path


def snapshot_env(tmp: str) -> dict:
    """PYTHONPATH pointing at a copy of src/ taken now, and the commit it was taken from (with
    "+local" when the checkout had uncommitted edits) for the results."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "HEAD") + ("+local" if git("status", "--porcelain", "--untracked-files=no", "src") else "")
    shutil.copytree(ROOT / "src", Path(tmp) / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return {**os.environ, "PYTHONPATH": str(Path(tmp) / "src"), "ONEGPU_BENCH_COMMIT": commit}


def bench(args: list[str], env: dict | None) -> int:
    cmd = [sys.executable, "-m", "onegpu.cli.main", "bench", "train", *args]
    print("+", " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("cpu", "headline", "gpu"):
        print(__doc__)
        return 2
    what, extra = argv[0], [a for a in argv[1:] if a != "--snapshot"]
    stamp = time.strftime("%Y%m%d")
    with tempfile.TemporaryDirectory(prefix="onegpu-snapshot-") as tmp:
        env = snapshot_env(tmp) if "--snapshot" in argv else None
        out = ["--bench.out", str(RESULTS)]
        if what == "cpu":
            return bench(CPU + out + ["--bench.name", f"train-cpu-{stamp}"] + extra, env)
        if what == "headline":
            return bench(HEADLINE + out + ["--bench.name", f"train-cpu-{stamp}-vs-hf"] + extra, env)
        model = ["--model.name", str(saved_model(Path(tmp) / "llama-1b")), "--model.from_scratch", "false"]
        rc = bench(GPU + model + out + ["--bench.name", f"train-gpu-{stamp}-text"] + extra, env)
        chat = chat_data(Path(tmp) / "chat.jsonl")
        return rc or bench(GPU + model + out + ["--data.path", str(chat), "--bench.arms", GPU_CHAT_ARMS,
                                                "--bench.name", f"train-gpu-{stamp}-chat"] + extra, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
