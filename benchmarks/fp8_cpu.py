"""FP8's numerics on this CPU, at the default job's shape: `onegpu train` with no arguments (the
`tiny` preset, 16 x 256 tokens a step, 200 steps, compiled: a 200-step run compiles), against the
same command with `--techniques.fp8 tensorwise --techniques.fp8_emulate true` (torchao's float8
casts and scales, multiplied in fp32: there are no FP8 tensor cores on a CPU), same seed, same
data. Then exact resume: the FP8 run writes a checkpoint at step 100 and a third run resumes from
it to step 200; its losses and final weights must equal the straight run's bit for bit.

    flock /work/.bench.lock python benchmarks/fp8_cpu.py [--steps 200] [--recipe tensorwise]

Writes results/fp8-cpu-<date>.{json,md}: each run's validation losses, the FP8/fp32 ratio at the
last step (target: within 2%), the resume check, the command lines, load before and after, the
commit and versions. Timings are recorded but are not FP8's speed: emulation does more work than
fp32, not less (FP8's speed is measured on a card: scripts/gpu_check.sh fp8).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from onegpu.bench import provenance  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGET = 0.02  # the FP8 run's last validation loss within 2% of fp32's
# Every run trains from a copy of src/ taken at the start (edits to the checkout while the runs go
# on cannot change them); the results record the commit it was taken from.
SNAPSHOT: list[str] = []


def onegpu_train(args: list[str], out: Path, name: str) -> tuple[list[dict], float]:
    """`onegpu train ARGS` into out/name, from the snapshot of src/ (SNAPSHOT); its metrics
    records and wall seconds."""
    cmd = [sys.executable, "-m", "onegpu.cli.main", "train", *args]
    cmd += ["--output.dir", str(out), "--output.name", name, "--output.report_to", "none"]
    print("+", " ".join(["onegpu", *cmd[3:]]), flush=True)
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": SNAPSHOT[0]})
    metrics = out / name / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()], time.time() - start


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["split"] == "val"}


def train_losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train" and "loss" in r]


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def load(p):
        out = {}
        for f in sorted(p.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    wa, wb = load(a), load(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def run(steps: int, recipe: str, out: Path) -> dict:
    half = steps // 2
    fp8 = ["--techniques.fp8", recipe, "--techniques.fp8_emulate", "true"]
    limit = ["--training.max_steps", str(steps)] if steps != 200 else []
    doc: dict = {"runs": {}}
    fp32, secs = onegpu_train(limit, out, "fp32")
    doc["runs"]["fp32"] = {"args": limit, "val": val_losses(fp32), "seconds": secs}
    args = limit + fp8 + ["--training.save_every", str(half)]
    straight, secs = onegpu_train(args, out, "fp8")
    doc["runs"]["fp8"] = {"args": args, "val": val_losses(straight), "seconds": secs}
    shutil.copytree(out / "fp8" / "final", out / "fp8-final-straight")
    ckpt = out / "fp8" / f"checkpoint-{half:08d}"
    resumed_args = args + ["--output.resume", str(ckpt)]
    resumed, secs = onegpu_train(resumed_args, out, "fp8")
    doc["runs"]["fp8-resumed"] = {"args": resumed_args, "seconds": secs}
    # the resumed run rewrites the run's metrics from the checkpoint on: the file must come out as
    # the straight run wrote it
    doc["resume"] = {
        "from_step": half,
        "train_losses_equal": train_losses(resumed) == train_losses(straight),
        "val_losses_equal": val_losses(resumed) == val_losses(straight),
        "final_weights_equal": same_weights(out / "fp8-final-straight", out / "fp8" / "final"),
    }
    last = max(doc["runs"]["fp32"]["val"])
    ref, got = doc["runs"]["fp32"]["val"][last], doc["runs"]["fp8"]["val"][last]
    doc["at_step"] = last
    doc["ratio"] = got / ref
    doc["met"] = abs(got / ref - 1) <= TARGET and all(doc["resume"].values())
    return doc


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "torchao", "transformers")}


def markdown(doc: dict) -> str:
    fp32, fp8 = doc["runs"]["fp32"]["val"], doc["runs"]["fp8"]["val"]
    rows = "\n".join(
        f"| {s} | {fp32[s]:.4f} | {fp8[s]:.4f} | {fp8[s] / fp32[s]:.4f} |" for s in sorted(fp32)
    )
    r, secs = doc["resume"], {k: f"{v['seconds']:.0f} s" for k, v in doc["runs"].items()}
    busy = max(doc["load"]["before"][0], doc["load"]["after"][0]) > 1.5
    busy_note = " (a shared machine: other work was running)" if busy else ""
    return f"""# FP8 (emulated) against fp32 at the default job's shape, CPU

`onegpu train` (the default job: `tiny` preset, 16 x 256 tokens a step, compiled) against the same
command with `--techniques.fp8 {doc["recipe"]} --techniques.fp8_emulate true`. Validation loss:

| step | fp32 | fp8 {doc["recipe"]} (emulated) | fp8 / fp32 |
|---|---|---|---|
{rows}

{provenance.markdown(doc)}
At step {doc["at_step"]}: **{doc["ratio"]:.4f}** (target: within {TARGET:.0%}):
{"met" if abs(doc["ratio"] - 1) <= TARGET else "missed"}.

Exact resume (the FP8 run resumed from its step-{r["from_step"]} checkpoint to the end): training
losses equal {r["train_losses_equal"]}, validation losses equal {r["val_losses_equal"]}, final
weights bitwise equal {r["final_weights_equal"]}.

Wall time (start-up, compile, evaluation and saving included; not FP8's speed: emulation does
more work than fp32): fp32 {secs["fp32"]}, fp8 {secs["fp8"]}, resumed half {secs["fp8-resumed"]}.

torchao {doc["versions"]["torchao"]}{busy_note}.
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipe", default="tensorwise")
    parser.add_argument("--name", default=f"fp8-cpu-{time.strftime('%Y%m%d')}")
    args = parser.parse_args(argv)
    load_before = list(os.getloadavg())
    head = provenance.begin()  # the commit the snapshot below is taken from
    with tempfile.TemporaryDirectory(prefix="onegpu-fp8-cpu-") as tmp:
        shutil.copytree(ROOT / "src", Path(tmp) / "src", ignore=shutil.ignore_patterns("*.pyc"))
        SNAPSHOT.append(str(Path(tmp) / "src"))
        doc = run(args.steps, args.recipe, Path(tmp) / "runs")
    doc.update(provenance.end(head), versions=versions(), recipe=args.recipe)
    doc["load"] = {"before": load_before, "after": list(os.getloadavg())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(doc, indent=1, default=str))
    (RESULTS / f"{args.name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if doc["met"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
