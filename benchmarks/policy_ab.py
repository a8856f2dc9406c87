"""The engine's CPU policy rows (src/onegpu/infer/policy.py), each against the engine without it, on
two model shapes: one process per (preset, batch), one engine per variant over the same model
(each compiles its own steps), the variants' decode runs interleaved round by round.

    python benchmarks/policy_ab.py --presets tiny,125m --batches 1,16 --rounds 5

A compiled variant runs `onegpu bench infer --preset cpu`'s request (512-token prompts, 128 new
tokens, greedy); the eager window is measured on eager engines. ms per decode step after every
first token is out (engine_workloads.py's decode); median and range over the rounds. Writes
benchmarks/results/engine-policy-cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from engine_workloads import drive, engine, make_model, params, tokens  # noqa: E402
from serve_load_report import spread  # noqa: E402

from onegpu.bench import provenance  # noqa: E402

COMPILED_ROWS = ("cpu_attention_loops", "cpu_head_reduction")
VARIANTS = [("compiled, every row", "on", [])]
VARIANTS += [(f"compiled, {row} off", "on", [row]) for row in COMPILED_ROWS]
VARIANTS += [("eager, every row", "off", []), ("eager, eager_window off", "off", ["eager_window"])]


def ms_per_step(eng, prompts) -> tuple[float, list]:
    got = drive(eng, {eng.submit(p, params(128)): i for i, p in enumerate(prompts)})
    everyone = max(r["first"] for r in got.values())
    done = max(r["times"][-1] for r in got.values())
    out_by = min(
        sum(n for t, n in zip(r["times"], r["counts"], strict=True) if t <= everyone)
        for r in got.values()
    )
    return 1000 * (done - everyone) / (128 - out_by), [r["tokens"] for r in got.values()]


def measure(preset: str, batch: int, rounds: int, only: str = "") -> dict:
    model = make_model(preset, 1024)
    rng = random.Random(0)
    prompts = [tokens(rng, 512) for _ in range(batch)]
    engines, answers = {}, {}
    for label, mode, off in [v for v in VARIANTS if not only or v[0] in only.split(";")]:
        started = time.perf_counter()
        engines[label] = engine(
            model, {"max_slots": batch, "max_len": 640, "compile": mode, "policy_off": off}
        )
        _, answers[label] = ms_per_step(engines[label], prompts)  # warm-up: compiles
        took = time.perf_counter() - started
        print(f"{preset} b{batch} {label}: warm in {took:.0f} s", flush=True)
    runs = {label: [] for label in engines}
    for _ in range(rounds):
        for label, eng in engines.items():
            runs[label].append(ms_per_step(eng, prompts)[0])
        print(f"{preset} b{batch}: {[round(r[-1], 2) for r in runs.values()]}", flush=True)
    first = next(iter(answers.values()))
    return {
        "runs": runs,
        "summary": {k: spread(v) for k, v in runs.items()},
        "same_tokens": all(a == first for a in answers.values()),
    }


def markdown(r: dict) -> str:
    lines = [
        "# The engine's CPU policy rows, each on and off, on two shapes",
        "",
        provenance.markdown(r),
        f"{r['threads']} torch thread(s). One process per shape and batch, "
        f"an engine per variant over one model, {r['rounds']} interleaved rounds; ms per decode "
        "step after every first token (512-token prompts, 128 new tokens, greedy), median "
        "(min-max); the ratio is the variant's median over the same engine's with every row.",
        "",
    ]
    for key, res in r["results"].items():
        lines += [f"## {key}", "", "| variant | ms per step | vs every row |", "|---|---|---|"]
        for label, s in res["summary"].items():
            base = res["summary"]["eager, every row" if "eager" in label else "compiled, every row"]
            ratio = s["median"] / base["median"]
            lines.append(
                f"| {label} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {ratio:.3f} |"
            )
        lines += ["", f"greedy tokens the same in every variant: {res['same_tokens']}", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,125m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/engine-policy-cpu")
    ap.add_argument("--only", default="", help="';'-separated variant labels (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    head, results = provenance.begin(), {}
    out = ROOT / args.out
    for preset in args.presets.split(","):
        for batch in map(int, args.batches.split(",")):
            with torch.no_grad():
                results[f"{preset}, batch {batch}"] = measure(preset, batch, args.rounds, args.only)
            result = {
                **provenance.end(head),
                "threads": args.threads,
                "rounds": args.rounds,
                "results": results,
            }
            out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
