"""The benchmark code's share of the project's non-test lines.

    python scripts/bench_share.py

Counted: every line (blank and comment lines too, as `wc -l` counts them) of the Python files
under src/, benchmarks/ and scripts/; the tests (tests/) are left out of both sides. Benchmark
code is src/onegpu/bench/ (what `onegpu bench train|infer` runs) plus benchmarks/ (the scripts
behind the committed results). The target is at most 15%.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTED = ("src", "benchmarks", "scripts")
BENCH = ("src/onegpu/bench", "benchmarks")
TARGET = 0.15


def lines_by_file(root: Path = ROOT) -> dict[str, int]:
    """Lines of each counted Python file, by its path relative to ``root``."""
    out = {}
    for top in COUNTED:
        for path in sorted((root / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                with path.open("rb") as f:
                    out[path.relative_to(root).as_posix()] = sum(1 for _ in f)
    return out


def share(counts: dict[str, int]) -> tuple[int, int]:
    """(benchmark lines, all counted lines)."""
    bench = sum(n for p, n in counts.items() if any(p.startswith(b + "/") for b in BENCH))
    return bench, sum(counts.values())


def main() -> int:
    counts = lines_by_file()
    bench, total = share(counts)
    for folder in BENCH:
        n = sum(v for p, v in counts.items() if p.startswith(folder + "/"))
        print(f"{folder + '/':20} {n:6,} lines")
    print(f"{'non-test Python':20} {total:6,} lines")
    print(f"benchmark share: {bench / total:.1%} (target <= {TARGET:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
