"""Training memory at full model size on a simulated card: the planner's predicted peak against
PyTorch's MemTracker for one real optimizer step (onegpu's prepare_model, loss and train_step) on
fake tensors, attention routed to the kernel an sm80+ card runs. No GPU, no download.

    PYTHONPATH=src python benchmarks/simgpu_memory.py            # every row (~15 min, 2 cores)
    PYTHONPATH=src python benchmarks/simgpu_memory.py --only 1B  # rerun the rows whose label has "1B"

Writes benchmarks/results/simgpu-memory.json and .md (the table docs/planner.md shows). The harness
and what it substitutes: tests/simgpu/fullsize.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "simgpu"))

import fullsize
from fullsize import SETUPS

OUT = ROOT / "benchmarks" / "results" / "simgpu-memory"
PARTS = (("param", "weights"), ("grad", "gradients"), ("opt", "optimizer"), ("act", "activations"),
         ("temp", "backward transient"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only the rows whose label contains this text")
    args = p.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    for setup in SETUPS:
        if args.only and args.only not in setup.label:
            continue
        r = fullsize.row(setup)
        rows.append(r)
        print(f"{r['setup']:<70} tracked {r['tracked_gib']:7.2f}  predicted {r['predicted_gib']:7.2f}  "
              f"ratio {r['ratio']:.3f}  ({r['step_seconds']:.0f} s)", flush=True)
    meta = {"torch": _version("torch"), "transformers": _version("transformers"),
            "machine": platform.machine(), "seconds": round(time.perf_counter() - t0, 1)}
    if args.only and OUT.with_suffix(".json").is_file():  # update those rows, keep the others
        fresh = {r["setup"]: r for r in rows}
        kept = json.loads(OUT.with_suffix(".json").read_text())["rows"]
        rows = [fresh.pop(r["setup"], r) for r in kept] + list(fresh.values())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(rows, meta))
    bad = [r["setup"] for r in rows if abs(r["ratio"] - 1) > fullsize.TOLERANCE]
    print(f"{len(rows)} rows in {meta['seconds']:.0f} s; outside ±{fullsize.TOLERANCE:.0%}: {bad or 'none'}")
    return 1 if bad else 0


def markdown(rows: list[dict], meta: dict) -> str:
    head = ("| setup | tracked GiB | predicted GiB | ratio | tracked: params / grads / optimizer / "
            "activations / temp | predicted: weights / grads / optimizer / activations / transient |\n"
            "|---|---:|---:|---:|---|---|\n")
    lines = []
    for r in rows:
        t, p = r["tracked_parts_gib"], r["predicted_parts_gib"]
        tracked = " / ".join(f"{t.get(k, 0.0):.2f}" for k, _ in PARTS)
        predicted = " / ".join(f"{p.get(k, 0.0):.2f}" for _, k in PARTS)
        lines.append(f"| {r['setup']} | {r['tracked_gib']:.2f} | {r['predicted_gib']:.2f} | "
                     f"{r['ratio']:.3f} | {tracked} | {predicted} |")
    note = (f"\nOne optimizer step after a warm one, MemTracker's peak (torch {meta['torch']}, "
            f"transformers {meta['transformers']}); predicted: `plan.memory.estimate` on a GPU, "
            "before the allocator's fragmentation and the CUDA context that `reserved()` adds.\n")
    return head + "\n".join(lines) + "\n" + note


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
