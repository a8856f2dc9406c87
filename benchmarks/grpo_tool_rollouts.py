"""The reward curve of a finished GRPO run of the built-in calculator job (`onegpu train
--training.objective grpo --grpo.tools '[calculator]'`), read from its metrics.jsonl, as a results
page.

    python benchmarks/grpo_tool_rollouts.py --curve RUN_DIR --out results/NAME

The rollouts' A/B, the prefix cache on and off (results/grpo-tool-rollouts-cpu.*), was measured
once by this script at bdedc66 (`git show bdedc66:benchmarks/grpo_tool_rollouts.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from onegpu.bench import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curve", required=True, help="a calculator job's run folder")
    ap.add_argument("--out", default=None, help="results path without suffix (.md and .json)")
    args = ap.parse_args()
    curve(Path(args.curve), args.out)


def curve(run: Path, out: str | None) -> None:
    """The reward curve of a calculator job's run: training and validation rewards, tool calls
    and errors, turns, as logged."""
    header = provenance.end(provenance.begin())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train" and "reward" in r]
    val = [r for r in records if r.get("split") == "val" and "reward" in r]
    # with several rewards, each one's mean beside their weighted sum (a reward weighted 0 is
    # logged, not trained on)
    each = sorted({k for r in train for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    each = each if len(each) > 1 else []
    keys = ("reward", *each, "tool_calls", "turns", "completion_length", "prefix_hit_ratio")
    lines = [
        "# GRPO with tools: the built-in calculator job's reward curve",
        "",
        provenance.markdown(header),
        f"The run: `{run}` (its config.yaml and metrics.jsonl; the header's load is the load when "
        "this page was written, not the run's). Training rows: the mean over the steps since the "
        "previous row (tool_calls: their count); validation: held-out questions, 8 conversations "
        "each.",
        "",
        "| split | step | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for split, rows in (("train", train), ("val", val)):
        for r in rows:
            cells = [
                f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys
            ]
            lines.append(f"| {split} | {r.get('step')} | " + " | ".join(cells) + " |")
    errors = sorted({k for r in train for k in r if k.startswith("tool_errors/")})
    if errors:
        totals = {k: sum(r.get(k, 0) for r in train) for k in errors}
        lines += [
            "",
            "Tool errors over the run: " + ", ".join(f"{k} {v:g}" for k, v in totals.items()),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out = HERE / out
        out.with_suffix(".md").write_text(text, encoding="utf-8")
        data = {"header": header, "run": str(run), "train": train, "val": val}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
