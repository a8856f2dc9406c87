"""FP8 on a card: the measured ratios of `bench_train.py gpu-fp8` / `gpu-fp8-3b` against the
planner's prediction for the same run, and the issue's targets, in one table.

    python benchmarks/fp8_gpu_report.py RESULTS.json [RESULTS.json ...] [--out fp8-gpu.md]
    python benchmarks/fp8_gpu_report.py --run gpu-fp8 --dir DIR     # scripts/gpu_check.sh fp8

``--run PRESET`` first checks that this torchao has the float8 training API onegpu uses, then
runs `bench_train.py PRESET` into DIR and reports on its results (DIR/fp8-gpu-<shape>.md).

Each results file is a `onegpu bench train` document with a `baseline` (bf16 compiled) and an
`fp8` arm (and, for the 1b preset, `hf-trainer-tuned`). Measured: the median over rounds of the
fp8 arm's tokens/s (and training memory) over the baseline's of the same round; predicted:
`onegpu.bench.fp8.predicted` for the run's settings on the card the document names (its layers as
the arm ran them). Targets (issue 42): the 1b preset >= 1.10x bf16 compiled and >= 1.35x HF
Trainer with the guide's flags; the 3B shape >= 1.2x at equal or lower memory; predicted FP8/bf16
within +-10% of measured on each shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEED = {"1b": 1.10, "3b": 1.20}
VS_HF = 1.35
PREDICTION = 0.10


def row(doc: dict) -> dict:
    """One results document's figures."""
    from onegpu import hardware
    from onegpu.bench.fp8 import predicted

    arms = doc["arms"]
    fp8, base = arms.get("fp8", {}), arms.get("baseline", {})
    hf = (doc.get("vs_hf_trainer_tuned") or {}).get("fp8", {})
    model = doc["setup"]["model_name"]
    spec = hardware.find_gpu(doc["device"]["name"])
    skip = fp8.get("overrides", {}).get("techniques.fp8_skip", "")
    pred = predicted(doc["config"], spec, skip) if fp8.get("status") == "ok" else {}
    return {
        "model": model,
        "shape": "3b" if "3b" in Path(model).name else "1b",
        "device": doc["device"]["name"],
        "fp8_status": fp8.get("status"),
        "fp8_reason": fp8.get("reason"),
        "fp8_skip": skip,
        "bf16_tokens_per_s": base.get("tokens_per_s"),
        "fp8_tokens_per_s": fp8.get("tokens_per_s"),
        "speed_x": fp8.get("speed_x"),
        "memory_x": fp8.get("memory_x"),
        "vs_hf_tuned": hf.get("speed_x"),
        "predicted": pred.get("ratio"),
        "predicted_peak_gib": pred.get("peak_gib"),
        "float8_evidence": (fp8.get("reps") or [{}])[0].get("evidence", {}).get("float8_layers"),
    }


def verdicts(r: dict) -> list[str]:
    out = []
    target = SPEED[r["shape"]]
    if r["speed_x"] is not None:
        met = r["speed_x"] >= target
        if r["shape"] == "3b":
            met = met and (r["memory_x"] or 9) <= 1.0
        out.append(f"fp8/bf16 {r['speed_x']:.3f}x (target >= {target}x): {_met(met)}")
    if r["vs_hf_tuned"] is not None:
        out.append(
            f"fp8/HF tuned {r['vs_hf_tuned']:.3f}x (>= {VS_HF}x): {_met(r['vs_hf_tuned'] >= VS_HF)}"
        )
    if r["speed_x"] and r["predicted"]:
        off = r["predicted"] / r["speed_x"] - 1
        out.append(
            f"predicted {r['predicted']:.3f}x, {off:+.1%} of measured (+-10%): "
            f"{_met(abs(off) <= PREDICTION)}"
        )
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def markdown(rows: list[dict]) -> str:
    lines = [
        "# FP8 on a card: measured against bf16 compiled, HF Trainer and the planner",
        "",
        "| shape | device | bf16 tok/s | fp8 tok/s | fp8/bf16 | memory | fp8/HF tuned | predicted "
        "| float8 layers | kept in bf16 |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        f = lambda v, p=3: "-" if v is None else f"{v:,.{p}f}"  # noqa: E731
        lines.append(
            f"| {r['shape']} | {r['device']} | {f(r['bf16_tokens_per_s'], 0)} | "
            f"{f(r['fp8_tokens_per_s'], 0)} | {f(r['speed_x'])} | {f(r['memory_x'])} | "
            f"{f(r['vs_hf_tuned'])} | {f(r['predicted'])} | {r['float8_evidence']} | "
            f"{r['fp8_skip'] or '-'} |"
        )
    lines.append("")
    for r in rows:
        status = (
            "" if r["fp8_status"] == "ok" else f" (fp8 arm {r['fp8_status']}: {r['fp8_reason']})"
        )
        lines.append(f"- {r['shape']}{status}: " + "; ".join(verdicts(r)))
    return "\n".join(lines) + "\n"


def check_torchao() -> str:
    """The float8 training API techniques/fp8.py uses, in this torchao: a clear failure now."""
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    from torchao.float8.float8_linear import Float8Linear  # noqa: F401

    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        Float8LinearConfig.from_recipe_name(recipe)
    return f"torchao {torchao.__version__}: float8 training API ok"


def run_preset(preset: str, out: Path) -> Path:
    """bench_train.py PRESET into ``out``; the results file it wrote."""
    import subprocess

    name = f"train-{preset}"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), preset]
    cmd += ["--bench.out", str(out), "--bench.name", name]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out / f"{name}.json"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="*")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    p.add_argument("--run", default=None, help="a bench_train.py FP8 preset to run first")
    p.add_argument("--dir", default=".", help="with --run: where its results and the report go")
    args = p.parse_args(argv)
    if args.run:
        print(check_torchao(), flush=True)
        args.results = [str(run_preset(args.run, Path(args.dir)))]
        shape = "3b" if args.run.endswith("3b") else "1b"
        args.out = args.out or str(Path(args.dir) / f"fp8-gpu-{shape}.md")
    rows = [row(json.loads(Path(f).read_text())) for f in args.results]
    text = markdown(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["fp8_status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
