"""`onegpu serve --compile on`: how long a start takes with the warm-up, the first time (an empty
compile cache) and the second (the cache the first filled), and what a load pays for compiling
after the server said it was ready — warm (counted in /metrics: 0 expected) and with the warm-up
off (the shapes compile mid-load, stalling every stream).

    python benchmarks/serve_warm_start.py --out benchmarks/results/serve-warm-start-cpu

Each round: a fresh cache folder; the first start, the load, stop; the second start, the load,
stop; a start with --warmup off, the load, stop. Each start is a new process (the time to ready
is from launch to /health's 200: Python's imports and the model's load included)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import ROOT, free_port, make_model, stop_server  # noqa: E402

from onegpu.bench import provenance  # noqa: E402

PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A:\n    pass\n", "x = 1\n" * 3]


def start(model: Path, port: int, cache: Path, warmup: str, args, log: Path):
    argv = [sys.executable, "-m", "onegpu", "serve", "--model", str(model), "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--compile", "on", "--warmup", warmup]
    argv += ["--max_slots", str(args.max_slots), "--max_len", str(args.max_len)]
    argv += ["--compile_cache", str(cache)]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    began = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    while proc.poll() is None and time.perf_counter() - began < 1200:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - began
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")


def load(port: int, args) -> dict:
    """``args.clients`` clients, each its share of the requests (greedy and sampled, answers of
    several lengths: every batch and KV bucket is reached); the seconds of the slowest request
    and the compiles /metrics counted."""
    url = f"http://127.0.0.1:{port}"
    jobs = [
        dict(
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=[8, args.max_len // 4, args.max_len // 2, args.max_len - 32][i % 4],
            temperature=[0.0, 1.0][(i // 2) % 2],
            seed=i,
            ignore_eos=True,
        )
        for i in range(args.requests)
    ]
    slowest, errors = [], []

    def client(mine):
        with httpx.Client(timeout=600) as http:
            for job in mine:
                t = time.perf_counter()
                r = http.post(f"{url}/v1/completions", json=job)
                slowest.append(time.perf_counter() - t)
                if r.status_code != 200:
                    errors.append(r.text[:200])

    threads = [
        threading.Thread(target=client, args=(jobs[c :: args.clients],))
        for c in range(args.clients)
    ]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    metrics = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("onegpu_decode_compile"):
            metrics[name] = float(value)
    return dict(
        wall_s=wall,
        slowest_s=max(slowest),
        errors=len(errors),
        first_error=errors[0] if errors else None,
        compiles=metrics.get("onegpu_decode_compiles_total", -1),
        compile_s=metrics.get("onegpu_decode_compile_seconds_total", -1),
    )


def warm_line(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("warm-up: ")]
    return lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max_slots", type=int, default=4)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve-warm-start-cpu")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warm-start-"))
    model = work / "model"
    make_model(model)
    head, runs = provenance.begin(), []
    for r in range(args.rounds):
        cache = work / f"cache{r}"
        row = {}
        for arm, warmup in (("first", "on"), ("second", "on"), ("no_warmup", "off")):
            port, log = free_port(), work / f"round{r}-{arm}.log"
            proc, ready = start(
                model, port, cache if arm != "no_warmup" else work / f"nw{r}", warmup, args, log
            )
            row[arm] = dict(ready_s=ready, warmup=warm_line(log), **load(port, args))
            row[arm]["exit"] = stop_server(proc)
            print(r, arm, json.dumps(row[arm]), flush=True)
        runs.append(row)
    result = dict(
        **provenance.end(head),
        settings=vars(args) | {"out": str(args.out)},
        runs=runs,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(args.out.with_suffix(".md").read_text())
    return 0


def _med(values, digits: int = 1) -> str:
    m, lo, hi = statistics.median(values), min(values), max(values)
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def markdown(res: dict) -> str:
    runs, s, m = res["runs"], res["settings"], res["machine"]
    arms = ("first", "second", "no_warmup")
    names = {
        "first": "first start (empty compile cache)",
        "second": "second start (the cache of the first)",
        "no_warmup": "--warmup off (empty cache)",
    }
    lines = [
        f"# `onegpu serve --compile on`: warm start ({m.get('gpu') or 'CPU'})",
        "",
        provenance.markdown(res),
        f"The `tiny` preset (fp32), --max_slots {s['max_slots']} --max_len {s['max_len']}, "
        "server torch threads 1.",
        "",
        f"{len(runs)} rounds, each: a fresh compile cache; the first start, the load, stop; the "
        "second start over that cache, the load, stop; a start with --warmup off (its own empty "
        f"cache), the load, stop. The load: {s['requests']} completions from {s['clients']} "
        "clients, greedy and sampled, 8 to max_len - 32 tokens (every batch and KV-length "
        "bucket). Median (min-max) over rounds.",
        "",
        "| start | ready s | load wall s | slowest request s | compiles during the load "
        "| their s |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        col = [r[arm] for r in runs]
        lines.append(
            f"| {names[arm]} | {_med([c['ready_s'] for c in col])} | "
            f"{_med([c['wall_s'] for c in col])} | {_med([c['slowest_s'] for c in col])} | "
            f"{_med([c['compiles'] for c in col])} | {_med([c['compile_s'] for c in col])} |"
        )
    ratio = [r["second"]["ready_s"] / r["first"]["ready_s"] for r in runs]
    errors = sum(r[a]["errors"] for r in runs for a in arms)
    lines += [
        "",
        f"Second start / first start (ready, per round): {_med(ratio, 2)} "
        f"(target: at most 0.33). Errors: {errors}. Server exit codes: "
        f"{sorted({r[a]['exit'] for r in runs for a in arms})}.",
        "",
        "The servers' own warm-up lines, round 1:",
        "",
        *[f"- {names[a]}: `{runs[0][a]['warmup'] or '(none)'}`" for a in arms],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
