"""A reward model on the default pairs: held-out accuracy by step, from the default SFT job.

Runs, each a plain `onegpu train` in its own process: the default job (SFT of the `tiny` preset,
200 steps), then a reward model from its final model on the default pair data
(`data/pairs.corpus_pairs`), evaluated on the 128 held-out pairs of the validation split's files
every --eval_every steps. Writes the curve (val accuracy, margin and loss; train accuracy as the
mean of the logged steps since the previous row) with the results header.

    PYTHONPATH=src python benchmarks/reward_accuracy.py --runs /tmp/rm \
        --out benchmarks/results/reward-model-accuracy-cpu
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from onegpu.bench import provenance  # noqa: E402

REWARD = ["--training.objective", "reward", "--training.eval_batches", "8"]


def train(runs: Path, args: list[str]) -> Path:
    """One `onegpu train` into a fresh folder under ``runs``; its run folder."""
    runs.mkdir(parents=True, exist_ok=True)
    before = set(runs.iterdir())
    subprocess.run(
        [sys.executable, "-m", "onegpu", "train", "--output.dir", str(runs), *args], check=True
    )
    (run,) = set(runs.iterdir()) - before
    return run


def rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def curve(metrics: list[dict]) -> list[dict]:
    """Each validation row with the mean train accuracy of the logged steps since the last one."""
    out, window = [], []
    for row in metrics:
        if row.get("split") == "train" and "reward_accuracy" in row:
            window.append(row["reward_accuracy"])
        elif row.get("split") == "val" and "reward_accuracy" in row:
            train_acc = sum(window) / len(window) if window else None
            out.append({**row, "train_accuracy": train_acc})
            window = []
    return out


def page(data: dict) -> str:
    """The results page of one measurement (the JSON ``main`` writes)."""
    sft_val = [r for r in data["sft"] if r.get("split") == "val"]
    points = curve(data["reward"])
    lines = [
        "# Reward model on the default pairs: held-out accuracy by step (CPU)",
        "",
        provenance.markdown(data["header"]),
        f"SFT start: the default job (`onegpu train`, final val loss {sft_val[-1]['loss']:.2f}); "
        f"reward model: `onegpu train {' '.join(data['reward_args'][:-2])} --model.name "
        "<sft>/final`. Held-out: the 128 pairs made from the validation split's files, never "
        "trained on; val accuracy is the share scored chosen above rejected. 16 pairs a step, "
        "fp32.",
        "",
        "| step | val accuracy | val margin | val loss | train accuracy |",
        "|---|---|---|---|---|",
    ]
    for p in points:
        train_acc = "" if p["train_accuracy"] is None else f"{p['train_accuracy']:.3f}"
        lines.append(
            f"| {p['step']} | **{p['reward_accuracy']:.3f}** | {p['reward_margin']:.3f} "
            f"| {p['loss']:.3f} | {train_acc} |"
        )
    lines += ["", f"Best held-out accuracy: {max(p['reward_accuracy'] for p in points):.3f}."]
    over = [i for i, p in enumerate(points) if p["reward_accuracy"] >= 0.9]
    if over:
        after = [p["reward_accuracy"] for p in points[over[0] :]]
        lines[-1] += (
            f" First at or above 0.9 at step {points[over[0]]['step']}; from there to the end "
            f"{min(after):.3f}-{max(after):.3f}."
        )
    lines += [
        "",
        "The pairs: six lines of a standard-library file as the prompt, the four real lines after "
        "them chosen, the same four lines with their words shuffled rejected (indentation and line "
        "breaks kept: only the order of words tells them apart, which the SFT model has learnt). "
        "The lr is given on the command line; a pretrained start's default is TRL's RewardConfig "
        "1e-4 (hyper.py). The CPUs were shared during the runs: the load changes their wall time, "
        "which these figures (accuracies, not timings) do not depend on.",
    ]
    if data["header"].get("note"):
        lines += ["", data["header"]["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, help="folder for the two runs")
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--steps", default="400")
    ap.add_argument("--eval_every", default="40")
    ap.add_argument("--out", help="results path without suffix (.md and .json written)")
    ap.add_argument("--page", type=Path, help="only rebuild the page of this results JSON")
    a = ap.parse_args()
    if a.page:
        data = json.loads(a.page.read_text(encoding="utf-8"))
        a.page.with_suffix(".md").write_text(page(data), encoding="utf-8")
        return
    header = provenance.begin()
    sft = train(a.runs / "sft", [])
    reward_args = [*REWARD, "--training.lr", a.lr, "--training.max_steps", a.steps]
    reward_args += ["--training.eval_every", a.eval_every, "--model.name", str(sft / "final")]
    rm = train(a.runs / "reward", reward_args)
    data = {"header": provenance.end(header), "reward_args": reward_args}
    data.update(runs={"sft": str(sft), "reward": str(rm)}, sft=rows(sft), reward=rows(rm))
    print(page(data))
    if a.out:
        Path(a.out).with_suffix(".json").write_text(json.dumps(data, indent=1), encoding="utf-8")
        Path(a.out).with_suffix(".md").write_text(page(data), encoding="utf-8")


if __name__ == "__main__":
    main()
