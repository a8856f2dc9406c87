"""The paged engine against the slot engine it replaced, and its switches against each other: each
arm a fresh process (benchmarks/engine_workloads.py) with its engine's source tree on PYTHONPATH,
the arms interleaved round by round, medians and ranges over the rounds.

    git worktree add --detach /tmp/slot-engine 3df78c9     # the slot engine's commit
    python benchmarks/engine_ab.py capacity --baseline /tmp/slot-engine --rounds 5

Workloads and their arms (what each measures: engine_workloads.py):

- decode: the slot engine and the paged one, eager and compiled, at batch 1 and 16 (with
  ``--before <checkout>``, also that earlier commit of the paged engine, compiled), and a plain
  transformers loop (StaticCache, forward and argmax compiled: ``naive``);
- capacity: the slot engine at 8 slots of 2,048 positions against the paged engine at the same
  KV memory (1,024 blocks of 16, the null block included) and 64 rows;
- chat, shared: the paged engine with its prefix cache on and off, and the slot engine;
- stall: the slot engine with its prefill thread off and on, and the paged engine, each with a
  long prompt arriving and without;
- budget: the stall workload on the paged engine at token budgets of 64 to 1,024 (the CPU's
  default is 256): the streams' gaps against the long prompt's time to its first token;
- rows: the decode workload on the paged engine, eager, at 8, 16 and 24 rows: what a row costs
  above 8 (the capacity workload runs up to 23).

Writes <out>.json and <out>.md: the machine, library versions, commit, command, date and the
1-minute load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load_report import percentiles, spread  # noqa: E402

from onegpu.bench import provenance  # noqa: E402

NEW_CAPACITY = {"max_slots": 64, "num_blocks": 1024}

ARMS = {
    "decode": [
        (f"{engine} {mode} b{batch}", engine, {"compile": mode}, ["--batch", str(batch)])
        for batch in (1, 16)
        for mode in ("off", "on")
        for engine in ("slot", "paged")
    ]
    # an earlier commit of the paged engine (--before), compiled: what a change to the step gained
    + [
        (f"paged-before on b{batch}", "before", {"compile": "on"}, ["--batch", str(batch)])
        for batch in (1, 16)
    ]
    # transformers' StaticCache and the model's forward with an argmax, compiled: no engine
    + [(f"naive b{batch}", "paged", {}, ["--batch", str(batch), "--naive"]) for batch in (1, 16)],
    "capacity": [
        ("slot engine, 8 slots", "slot", {"max_slots": 8}, []),
        ("paged engine, 64 rows", "paged", NEW_CAPACITY, []),
        # the rows as admitted: an ended sequence's row stays empty below the running ones
        (
            "paged engine, 64 rows, rows not compacted",
            "paged",
            {**NEW_CAPACITY, "compact_rows": False},
            [],
        ),
        # the same prompts, one new token each: the prompts' share of each engine's wall time
        ("slot engine, 8 slots, prompts only", "slot", {"max_slots": 8}, ["--prompts_only"]),
        ("paged engine, 64 rows, prompts only", "paged", NEW_CAPACITY, ["--prompts_only"]),
    ],
    "chat": [
        ("prefix caching on", "paged", {"max_slots": 4}, []),
        ("prefix caching off", "paged", {"max_slots": 4, "prefix_caching": False}, []),
        ("slot engine", "slot", {"max_slots": 4}, []),
    ],
    "shared": [
        ("prefix caching on", "paged", {"max_slots": 64}, []),
        ("prefix caching off", "paged", {"max_slots": 64, "prefix_caching": False}, []),
        ("slot engine", "slot", {"max_slots": 64}, []),
    ],
    "stall": [
        (f"{label}{', long prompt' if not alone else ''}", engine, cfg, ["--no_long"] * alone)
        for label, engine, cfg in (
            ("slot engine, prefill thread off", "slot", {"max_slots": 8, "prefill_thread": "off"}),
            ("slot engine, prefill thread on", "slot", {"max_slots": 8, "prefill_thread": "on"}),
            ("paged engine", "paged", {"max_slots": 8}),
        )
        for alone in (True, False)
    ],
    # the CPU's default token budget (policy.CPU_TOKEN_BUDGET, the cpu_token_budget row) against
    # others, on the stall workload: the running streams' gaps against the long prompt's time to
    # its first token
    "budget": [
        (f"token budget {n}", "paged", {"max_slots": 8, "token_budget": n}, [])
        for n in (64, 128, 256, 512, 1024)
    ],
    "rows": [
        (f"paged b{n}", "paged", {"compile": "off"}, ["--batch", str(n)]) for n in (8, 16, 24)
    ],
}


def run_arm(workload: str, arm: tuple, args, first: bool) -> dict:
    label, engine, config, extra = arm
    if first and args.alone and engine == "paged":  # once: every answer against it alone
        extra = [*extra, "--alone"]
    src = Path({"slot": args.baseline, "paged": args.paged, "before": args.before}[engine]) / "src"
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_workloads.py"), workload]
    cmd += ["--engine", json.dumps(config), "--threads", str(args.threads), *extra]
    cmd += ["--requests", str(args.requests), "--preset", args.preset]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{label}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT ")) | {"load1": os.getloadavg()[0]}


def figures(workload: str, run: dict) -> dict:
    """The figures a run is compared by."""
    if workload in ("decode", "rows"):
        return {"ms_per_step": run["ms_per_step"]}
    if workload == "capacity":
        keys = ("tokens_per_s", "peak_running", "wall_s", "peak_tokens", "live_rows")
        return {k: run[k] for k in keys if k in run}
    if workload in ("chat", "shared"):
        ttft = run["ttft_s"]
        values = [t for _, t in ttft] if workload == "chat" else ttft
        out = {
            "ttft_p50_s": statistics.median(values),
            "prompt_tokens": run["prompt_tokens_computed"],
        }
        if workload == "chat":
            out["ttft_p50_later_turns_s"] = statistics.median([t for turn, t in ttft if turn])
        return out
    gaps = run["gaps_s"]
    if workload == "budget":
        return {
            "gap_p99_s": percentiles(gaps)["p99"],
            "gap_p50_s": percentiles(gaps)["p50"],
            "long_ttft_s": run["long_ttft_s"],
        }
    return {
        "gap_p99_s": percentiles(gaps)["p99"],
        "gap_max_s": max(gaps),
        "gap_p50_s": percentiles(gaps)["p50"],
        "stream_tokens_per_s": run["stream_tokens_per_s"],
    }


def markdown(r: dict) -> str:
    lines = [
        f"# Engine A/B: {r['workload']} ({r['preset']}, {r['threads']} torch thread(s))",
        "",
        provenance.markdown(r),
        f"Slot engine: {r['baseline_commit']}"
        + (f"; paged-before: {r['before_commit']}" if r.get("before_commit", "-") != "-" else "")
        + f". {r['rounds']} interleaved rounds, each arm a fresh process; "
        "median (min-max) over rounds.",
        "",
    ]
    names = list(next(iter(r["summary"].values())))
    lines += ["| arm | " + " | ".join(names) + " | answers |", "|---" * (len(names) + 2) + "|"]
    for label, figs in r["summary"].items():
        cells = [_cell(figs[n]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['answers'][label]} |")
    if r["workload"] == "capacity" and len(r["summary"]) == 4:
        lines += ["", _decode_share(r["summary"])]
    return "\n".join(lines) + "\n"


def _decode_share(summary: dict) -> str:
    """What the answers' decoding costs each engine beyond computing the prompts (medians), and
    the most the paged engine's tokens/s could gain over the slot engine's if its decoding cost
    nothing."""
    wall = {label: figs["wall_s"]["median"] for label, figs in summary.items()}
    slot, paged, slot_p, paged_p = wall.values()
    return (
        f"The prompts alone (one new token each) take {slot_p:.2f} s (slot) and {paged_p:.2f} s "
        f"(paged) of the {slot:.2f} and {paged:.2f} s: decoding the answers costs the slot engine "
        f"{slot - slot_p:.2f} s and the paged one {paged - paged_p:.2f} s "
        f"({(slot - slot_p) / max(paged - paged_p, 1e-9):.2f}x). Were the paged engine's decoding "
        f"free, its tokens/s would be at most {slot / paged_p:.2f}x the slot engine's."
        + _peak_bound(summary["paged engine, 64 rows"])
    )


def _peak_bound(figs: dict) -> str:
    """The peak the pool allows sequences as long as those running at the paged engine's peak."""
    if "peak_tokens" not in figs:
        return ""
    running, held = figs["peak_running"]["median"], figs["peak_tokens"]["median"]
    pool = (NEW_CAPACITY["num_blocks"] - 1) * 16  # the null block holds no sequence
    each = held / running
    return (
        f" At its peak the paged engine's {running} sequences held {held} tokens ({each:.0f} "
        f"each): the pool's {pool} positions hold {pool / each:.1f} sequences of that length, "
        f"{pool / each / 8:.2f}x the slot engine's 8."
    )


def _cell(s: dict) -> str:
    fmt = (lambda v: f"{v:.4g}") if isinstance(s["median"], float) else str
    return f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=ARMS)
    ap.add_argument("--baseline", default="", help="a checkout of the slot engine's commit")
    ap.add_argument("--paged", default=str(ROOT), help="a checkout of the paged engine's commit")
    ap.add_argument("--before", default="", help="decode: a checkout of an earlier paged commit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each arm")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--arms", default="", help="comma-separated arm labels (default: all)")
    ap.add_argument("--timeout", type=float, default=3000, help="seconds per arm run")
    ap.add_argument("--out", default="")
    ap.add_argument("--alone", action="store_true", help="capacity: check each answer alone")
    args = ap.parse_args()
    arms = [a for a in ARMS[args.workload] if not args.arms or a[0] in args.arms.split(",")]
    arms = [a for a in arms if a[1] != "before" or args.before]
    if any(a[1] == "slot" for a in arms) and not args.baseline:
        ap.error("--baseline: a checkout of the slot engine's commit")
    head, runs = provenance.begin(path=Path(args.paged)), {a[0]: [] for a in arms}
    for rnd in range(args.rounds):
        for arm in arms:
            runs[arm[0]].append(run_arm(args.workload, arm, args, rnd == 0))
            print(f"round {rnd + 1}: {arm[0]}: {figures(args.workload, runs[arm[0]][-1])}")
    result = report(args, runs, head)
    name = args.workload + ("" if args.preset == "tiny" else f"-{args.preset}")
    out = ROOT / (args.out or f"benchmarks/results/engine-{name}-cpu")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0


def report(args, runs: dict, head: dict) -> dict:
    commit = provenance.commit
    summary = {}
    for label, rs in runs.items():
        figs = [figures(args.workload, r) for r in rs]
        summary[label] = {k: spread([f[k] for f in figs]) for k in figs[0]}
    return {
        "workload": args.workload,
        "preset": args.preset,
        "threads": args.threads,
        "rounds": args.rounds,
        **provenance.end(head),
        "baseline_commit": commit(Path(args.baseline)) if args.baseline else "-",
        "before_commit": commit(Path(args.before)) if args.before else "-",
        "answers": {
            k: ", ".join(sorted({str(r.get("answers", "-")) for r in v})) for k, v in runs.items()
        },
        "summary": summary,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
