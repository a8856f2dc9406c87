"""Two `onegpu serve` settings side by side under the load test's workload, interleaved.

    python benchmarks/serve_ab.py --a "--sync_every 1" --b ""      # two flags of one checkout
    python benchmarks/serve_ab.py --a_src ../other-checkout/src     # two commits, same flags

Both servers run at once on 127.0.0.1 (the idle one waits on its inbox), on the same `tiny` model
(``--preset 125m``: that shape, random weights, the same tokenizer) and the same 64 requests as
benchmarks/serve_load.py. Each round runs A's two phases (sequential,
then ``--clients`` at once), then B's, so a slow spell of a shared machine touches both. Reports
per setting the median over rounds (and the range) of each phase's tokens/s and p99 latency and of
the two ratios serve_load.py targets, and checks that every answer of B equals A's. Writes
<out>.json and <out>.md with the machine, load, command and date."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from serve_load import free_port, make_jobs, make_model, run_phase, start_server, stop_server  # noqa: E402
from serve_load_report import check, figures, spread  # noqa: E402

from onegpu.bench import provenance  # noqa: E402


def phases(client, jobs, clients: int, deadline: float) -> tuple:
    """A round of one setting: its sequential and concurrent phases (serve_load.py's)."""
    return tuple(run_phase(client, jobs, n, deadline) for n in (1, clients))


def round_figures(pair: tuple, jobs) -> dict:
    out = {}
    for name, phase in zip(("sequential", "concurrent"), pair, strict=True):
        f = figures(phase)
        out[name] = {
            "tokens_per_s": f["tokens_per_s"],
            "p99_s": f["latency_s"]["p99"],
            "errors": len(jobs) - f["requests"],  # failed or unanswered
            # the streamed answers: guidellm's inter-token latency, tokens per event, event gaps
            "itl_p50_s": f["itl_s"]["p50"],
            "tokens_per_event": f["tokens_per_event"],
            "event_gap_p99_s": f["event_gap_s"]["p99"],
        }
    s, c = out["sequential"], out["concurrent"]
    out["speedup"] = c["tokens_per_s"] / s["tokens_per_s"]
    out["latency_ratio"] = c["p99_s"] / s["p99_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="", help="server flags of setting A")
    ap.add_argument("--b", default="", help="server flags of setting B")
    ap.add_argument("--a_src", type=Path, default=ROOT / "src", help="the source A runs")
    ap.add_argument("--b_src", type=Path, default=ROOT / "src", help="the source B runs")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--time_limit", type=float, default=1500, help="seconds for all rounds")
    ap.add_argument("--server_threads", type=int, default=1, help="each server's torch threads")
    ap.add_argument("--preset", choices=["tiny", "125m"], default="tiny", help="model shape")
    ap.add_argument("--out", default="benchmarks/results/serve-ab-cpu")
    args = ap.parse_args()
    from openai import OpenAI

    head, jobs = provenance.begin(), make_jobs(args.requests)
    settings = {"A": args.a, "B": args.b}
    runs: dict[str, list] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp) / "tiny", args.preset)  # served as "tiny" whatever its shape
        servers = {}
        try:
            for name, flags in settings.items():
                port = free_port()
                opts = argparse.Namespace(**vars(args), server_args=flags)
                log = Path(tmp) / f"server-{name}.log"
                src = args.a_src if name == "A" else args.b_src
                proc = start_server(
                    f"{sys.executable} -m onegpu serve", Path(tmp) / "tiny", port, opts, log, src
                )
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
                servers[name] = (proc, client)
                run_phase(client, jobs[:2], 2, time.monotonic() + 60)  # warm-up
            deadline = time.monotonic() + args.time_limit
            for _ in range(args.rounds):
                for name, (_, client) in servers.items():
                    runs[name].append(phases(client, jobs, args.clients, deadline))
        finally:
            exits = {name: stop_server(proc) for name, (proc, _) in servers.items()}
    ok = check(jobs, runs["A"] + runs["B"])  # against A's first sequential answers
    rounds = {name: [round_figures(pair, jobs) for pair in pairs] for name, pairs in runs.items()}
    result = {
        **provenance.end(head),
        "preset": args.preset,
        "settings": settings,
        "sources": {"A": str(args.a_src), "B": str(args.b_src)},
        "server_exit": exits,
        "errors": ok["n_errors"] + len(ok["lost"]),
        "differ": ok["differ"],
        "summary": {
            name: {
                "sequential_tokens_per_s": spread([r["sequential"]["tokens_per_s"] for r in rs]),
                "concurrent_tokens_per_s": spread([r["concurrent"]["tokens_per_s"] for r in rs]),
                "sequential_p99_s": spread([r["sequential"]["p99_s"] for r in rs]),
                "concurrent_p99_s": spread([r["concurrent"]["p99_s"] for r in rs]),
                "speedup": spread([r["speedup"] for r in rs]),
                "latency_ratio": spread([r["latency_ratio"] for r in rs]),
                **{
                    f"{phase}_{key}": spread([r[phase][key] for r in rs])
                    for phase in ("sequential", "concurrent")
                    for key in ("itl_p50_s", "tokens_per_event", "event_gap_p99_s")
                },
            }
            for name, rs in rounds.items()
        },
        "rounds": rounds,
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result, args))
    print(out.with_suffix(".md").read_text())
    return 0 if not (result["errors"] or result["differ"]) else 1


def markdown(r: dict, args) -> str:
    def cell(x, scale=1.0, fmt="{:.0f}"):
        low, mid, high = (fmt.format(scale * x[k]) for k in ("min", "median", "max"))
        return f"{mid} ({low}-{high})"

    rows = []
    for name, s in r["summary"].items():
        flags = r["settings"][name] or "(defaults)"
        if r["sources"]["A"] != r["sources"]["B"]:
            flags += f"` from `{r['sources'][name]}"
        rows.append(
            f"| {name}: `{flags}` | {cell(s['sequential_tokens_per_s'])} | "
            f"{cell(s['concurrent_tokens_per_s'])} | {cell(s['speedup'], fmt='{:.2f}')}x | "
            f"{cell(s['sequential_p99_s'], 1000)} | {cell(s['concurrent_p99_s'], 1000)} | "
            f"{cell(s['latency_ratio'], fmt='{:.2f}')}x |"
        )
    streams = []
    for name, s in r["summary"].items():
        cells = [
            f"{cell(s[f'{phase}_itl_p50_s'], 1000, '{:.1f}')} | "
            f"{cell(s[f'{phase}_tokens_per_event'], fmt='{:.2f}')} | "
            f"{cell(s[f'{phase}_event_gap_p99_s'], 1000)}"
            for phase in ("sequential", "concurrent")
        ]
        streams.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(
        [
            "# onegpu serve: two settings under load, interleaved (loopback, CPU)",
            "",
            provenance.markdown(r),
            f"The load test's workload (`{args.preset}` preset, random weights, "
            "fp32; "
            f"{args.requests} greedy requests, mixed prompts and answers, streamed and not); "
            f"{args.rounds} rounds, each A's phases (sequential, then {args.clients} clients) then "
            f"B's; each server {args.server_threads} torch thread(s); exit codes after SIGTERM: "
            f"{r['server_exit']}.",
            "",
            "Median over rounds (range in brackets):",
            "",
            "| setting | sequential tokens/s | concurrent tokens/s | ratio | sequential p99 ms | "
            "concurrent p99 ms | p99 ratio |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "The streamed answers (half the requests): inter-token latency as guidellm reports it "
            "(a request's time after its first token over its other tokens; p50 over requests), "
            "tokens per server-sent event, and the p99 gap between a stream's events:",
            "",
            "| setting | sequential ITL p50 ms | tokens/event | event gap p99 ms | concurrent ITL "
            "p50 ms | tokens/event | event gap p99 ms |",
            "|---|---|---|---|---|---|---|",
            *streams,
            "",
            f"Checks: {r['errors']} errors; {len(r['differ'])} answers differing from A's first "
            "sequential answer (text, finish reason, token count) in any phase of either setting.",
            "",
            f"Command: `{r['command']}`",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
