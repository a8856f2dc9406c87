"""FP8's training memory at full model size on a simulated card: the planner's peak with
torchao's float8 layers against PyTorch's MemTracker for one real optimizer step at the 1B, 3B and
8B shapes (tests/simgpu/fp8_fullsize.py; the harness: tests/simgpu/fullsize.py). No GPU.

    PYTHONPATH=src python benchmarks/simgpu_fp8_memory.py            # every row (~1 h, 2 cores)
    PYTHONPATH=src python benchmarks/simgpu_fp8_memory.py --only 3B  # rows whose label has "3B"

Writes benchmarks/results/simgpu-fp8-memory.json and .md; target: every row within ±5%.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import fullsize  # noqa: E402 (importable only once sys.path names tests/simgpu)
from fp8_fullsize import FP8_SETUPS  # noqa: E402
from simgpu_memory import markdown  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "simgpu-fp8-memory"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated texts: rows whose label has one")
    args = p.parse_args(argv)
    wanted = [w for w in args.only.split(",") if w]
    path = OUT.with_suffix(".json")
    old = json.loads(path.read_text())["rows"] if wanted and path.is_file() else []
    rows = {r["setup"]: r for r in old}
    t0 = time.perf_counter()
    for setup in FP8_SETUPS:
        if wanted and not any(w in setup.label for w in wanted):
            continue
        r = fullsize.row(setup)
        print(
            f"{r['setup']:<80} tracked {r['tracked_gib']:7.2f}  predicted "
            f"{r['predicted_gib']:7.2f}  ratio {r['ratio']:.3f}  ({r['step_seconds']:.0f} s)",
            flush=True,
        )
        rows[r["setup"]] = r
        write([rows[s.label] for s in FP8_SETUPS if s.label in rows])
    bad = [r for r in rows.values() if abs(r["ratio"] - 1) > fullsize.TOLERANCE]
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s; outside ±5%: {len(bad)}")
    return 1 if bad else 0


def write(rows: list[dict]) -> None:
    from importlib.metadata import version

    meta = {p: version(p) for p in ("torch", "torchao", "transformers")}
    meta["machine"] = platform.machine()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, meta).replace(
        "One optimizer step", f"torchao {meta['torchao']}. One optimizer step"
    )
    OUT.with_suffix(".md").write_text("# FP8 at full size on the simulated card\n\n" + text)


if __name__ == "__main__":
    raise SystemExit(main())
