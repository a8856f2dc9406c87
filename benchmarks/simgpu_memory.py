"""Training memory at full model size on a simulated card: the planner's predicted peak against
PyTorch's MemTracker for one real optimizer step (onegpu's prepare_model, loss and train_step) on
fake tensors, attention routed to the kernel an sm80+ card runs. No GPU, no download.

    PYTHONPATH=src python benchmarks/simgpu_memory.py            # every row (~15 min, 2 cores)
    PYTHONPATH=src python benchmarks/simgpu_memory.py --only 1B  # rerun rows whose label has "1B"

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

import fullsize  # noqa: E402 (importable only once sys.path names tests/simgpu)
from fullsize import SETUPS  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "simgpu-memory"
PARTS = (
    ("param", "weights"),
    ("grad", "gradients"),
    ("opt", "optimizer"),
    ("act", "activations"),
    ("temp", "backward transient"),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only",
        default="",
        help="comma-separated texts: run only the rows whose label contains one of them, "
        "and update those rows in the results (the others are kept)",
    )
    args = p.parse_args(argv)
    wanted = [w for w in args.only.split(",") if w]
    t0 = time.perf_counter()
    rows = []
    for setup in SETUPS:
        if wanted and not any(w in setup.label for w in wanted):
            continue
        r = fullsize.row(setup)
        print(
            f"{r['setup']:<70} tracked {r['tracked_gib']:7.2f}  predicted "
            f"{r['predicted_gib']:7.2f}  ratio {r['ratio']:.3f}  ({r['step_seconds']:.0f} s)",
            flush=True,
        )
        rows = write(r, keep=bool(wanted) or bool(rows))  # after each row: a long run keeps them
    bad = [r["setup"] for r in rows if abs(r["ratio"] - 1) > fullsize.TOLERANCE]
    print(
        f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s; outside ±{fullsize.TOLERANCE:.0%}: "
        f"{bad or 'none'}"
    )
    return 1 if bad else 0


def write(r: dict, keep: bool) -> list[dict]:
    """Add or replace row ``r`` in the results (``keep``: beside the rows already there), rows in
    the order of SETUPS; returns all rows."""
    path = OUT.with_suffix(".json")
    old = json.loads(path.read_text())["rows"] if keep and path.is_file() else []
    by_label = {x["setup"]: x for x in old} | {r["setup"]: r}
    order = [s.label for s in SETUPS]
    rows = sorted(
        by_label.values(), key=lambda x: order.index(x["setup"]) if x["setup"] in order else 99
    )
    meta = {
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "machine": platform.machine(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(rows, meta))
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| setup | tracked GiB | predicted GiB | ratio | tracked: params / grads / optimizer / "
        "activations / temp | predicted: weights / grads / optimizer / activations / transient |\n"
        "|---|---:|---:|---:|---|---|\n"
    )
    lines = []
    for r in rows:
        t, p = r["tracked_parts_gib"], r["predicted_parts_gib"]
        tracked = " / ".join(f"{t.get(k, 0.0):.2f}" for k, _ in PARTS)
        predicted = " / ".join(f"{p.get(k, 0.0):.2f}" for _, k in PARTS)
        lines.append(
            f"| {r['setup']} | {r['tracked_gib']:.2f} | {r['predicted_gib']:.2f} | "
            f"{r['ratio']:.3f} | {tracked} | {predicted} |"
        )
    note = (
        f"\nOne optimizer step after a warm one, MemTracker's peak (torch {meta['torch']}, "
        f"transformers {meta['transformers']}); predicted: `plan.memory.estimate` on a GPU, "
        "before the allocator's fragmentation and the CUDA context that `reserved()` adds.\n"
    )
    return head + "\n".join(lines) + "\n" + note


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
