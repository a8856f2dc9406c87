"""The load test's checks, figures and report (benchmarks/serve_load.py runs it): answers compared
with their single-request answers, percentiles, tokens/s, and the JSON and Markdown written."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from onegpu.bench import provenance


# ------------------------------------------------------------------------------- checks, figures
def check(jobs, rounds) -> dict:
    """Errors, lost answers (a request a phase did not answer), and answers that differ from the
    first round's single-request ones (cut, mixed up or duplicated text shows here)."""
    reference = rounds[0][0].answers
    phases = [phase for pair in rounds for phase in pair]
    errors = [a.error for p in phases for a in p.answers.values() if a.error]
    lost = sorted({j.index for p in phases for j in jobs if j.index not in p.answers})
    differ = sorted(
        {
            j.index
            for p in phases
            for j in jobs
            if j.index in p.answers
            and j.index in reference
            and _key(p.answers[j.index]) != _key(reference[j.index])
        }
    )
    return {"errors": errors[:10], "n_errors": len(errors), "lost": lost, "differ": differ}


def _key(a) -> tuple:
    return a.text, a.finish, a.tokens


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p99": p99}


def figures(phase) -> dict:
    done = [a for a in phase.answers.values() if not a.error]
    tokens = sum(a.tokens for a in done)
    return {
        "requests": len(done),
        "tokens": tokens,
        "wall_s": phase.wall,
        "tokens_per_s": tokens / phase.wall if phase.wall else 0.0,
        "ttft_s": percentiles([a.ttft for a in done]),
        "latency_s": percentiles([a.latency for a in done]),
        **streaming(done),
    }


def streaming(done: list) -> dict:
    """Of the streamed answers: inter-token latency as guidellm reports it (a request's time after
    its first token over its other tokens), tokens per event, and the gaps between events."""
    streamed = [a for a in done if a.events and a.tokens > 1]
    if not streamed:
        return {}
    return {
        "itl_s": percentiles([(a.latency - a.ttft) / (a.tokens - 1) for a in streamed]),
        "tokens_per_event": sum(a.tokens for a in streamed) / sum(a.events for a in streamed),
        "event_gap_s": percentiles([g for a in streamed for g in a.gaps]),
    }


# ------------------------------------------------------------------------------- report
def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def _ms(seconds) -> str:
    """A phase that answered nothing (all timed out) has no percentile."""
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(per_round: list[dict]) -> dict:
    """Median and range over rounds of each figure of a phase."""
    return {
        "tokens_per_s": spread([f["tokens_per_s"] for f in per_round]),
        "wall_s": spread([f["wall_s"] for f in per_round]),
        **{
            f"{kind}_{q}": spread([f[f"{kind}_s"][q] for f in per_round])
            for kind in ("ttft", "latency")
            for q in ("p50", "p99")
        },
    }


def markdown(r: dict) -> str:
    s, c, ok = r["sequential"], r["concurrent"], r["check"]
    first = r["rounds"]["sequential"][0]
    many = r["engine_alone_tokens_per_s"][f"{r['clients']}_slots"]
    one = r["engine_alone_tokens_per_s"]["1_slots"]

    def ms(x):
        return (
            "-"
            if x["median"] is None
            else (f"{1000 * x['median']:.0f} ({1000 * x['min']:.0f}-{1000 * x['max']:.0f})")
        )

    rows = [
        f"| {name} | {f['tokens_per_s']['median']:.0f} ({f['tokens_per_s']['min']:.0f}-"
        f"{f['tokens_per_s']['max']:.0f}) | {ms(f['ttft_p50'])} | {ms(f['ttft_p99'])} | "
        f"{ms(f['latency_p50'])} | {ms(f['latency_p99'])} |"
        for name, f in (("sequential (1 client)", s), (f"concurrent ({r['clients']} clients)", c))
    ]
    per_round = [
        f"| {k + 1} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | {x:.2f}x | "
        f"{_ms(a['latency_s']['p99'])} | {_ms(b['latency_s']['p99'])} | {y:.2f}x |"
        for k, (a, b, x, y) in enumerate(
            zip(
                r["rounds"]["sequential"],
                r["rounds"]["concurrent"],
                r["rounds"]["speedup"],
                r["rounds"]["latency_ratio"],
                strict=True,
            )
        )
    ]
    t = r["targets"]
    return "\n".join(
        [
            "# onegpu serve under load (loopback, CPU)",
            "",
            provenance.markdown(r),
            f"{r['workload']}; {len(r['rounds']['speedup'])} rounds, each the "
            "sequential phase then the concurrent one; server torch threads "
            f"{r['server_threads']}, prefix caching {r.get('server_prefix_caching', '?')}; "
            f"server exit code after SIGTERM: {r['server_exit']}.",
            "",
            "Median over rounds (range in brackets), each phase "
            f"{first['requests']} requests and {first['tokens']} output tokens a round:",
            "",
            "| phase | tokens/s | TTFT p50 ms | TTFT p99 ms | latency p50 ms | latency p99 ms |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "| round | sequential tokens/s | concurrent tokens/s | ratio | sequential p99 ms | "
            "concurrent p99 ms | ratio |",
            "|---|---|---|---|---|---|---|",
            *per_round,
            "",
            "The engine alone (in this process, the same requests all submitted at once, no "
            f"HTTP, once after the rounds): "
            f"{many:.0f} tokens/s with {r['clients']} slots, {one:.0f} with 1 ({many / one:.2f}x).",
            "",
            _counters(r.get("server_counters") or {}),
            "",
            f"Checks: {ok['n_errors']} errors, {len(ok['lost'])} lost, {len(ok['differ'])} answers "
            "differing from their single-request answer of the first round (text, finish reason, "
            "token count), over every phase of every round.",
            "",
            f"Targets (median of the rounds' paired ratios): concurrent tokens/s >= 4x sequential: "
            f"{t['speedup']:.2f}x ({'met' if t['speedup_met'] else 'missed'}); concurrent p99 "
            f"latency < 3x the single-request p99: {t['latency_ratio']:.2f}x "
            f"({'met' if t['latency_met'] else 'missed'}); against the single-request median "
            f"latency instead: {t['latency_ratio_vs_median']:.2f}x (the mix holds answers of 16 to "
            "128 tokens, so the p99 of either phase is a long answer).",
            "",
            f"How the two targets relate: a request that decodes beside {r['clients'] - 1} others "
            f"all its life runs at (tokens/s ratio)/{r['clients']} of its speed alone, here "
            f"{r['clients'] / t['speedup']:.2f}x its time alone; the p99 request shares the batch "
            "with fewer at the phase's start and end. The engine alone reaches "
            f"{many / one:.2f}x on this machine.",
            "",
            f"Command: `{r['command']}`",
            "",
        ]
    )


def report(args, jobs, rounds, head: dict, exit_code: int) -> dict:
    """``head``: provenance.begin()'s header, taken before the run."""
    singles = [figures(single) for single, _ in rounds]
    togethers = [figures(together) for _, together in rounds]
    speedup = [
        c["tokens_per_s"] / s["tokens_per_s"] if s["tokens_per_s"] else 0.0
        for s, c in zip(singles, togethers, strict=True)
    ]
    ratio, vs_median = [], []
    for s, c in zip(singles, togethers, strict=True):
        p99_single, p99_together = s["latency_s"]["p99"], c["latency_s"]["p99"]
        ok = p99_single and p99_together
        ratio.append(p99_together / p99_single if ok else float("inf"))
        vs_median.append((p99_together or 0) / (s["latency_s"]["p50"] or 1))
    return {
        **provenance.end(head),
        "clients": args.clients,
        "server_threads": args.server_threads,
        "workload": (
            f"`tiny` preset (random weights, fp32), {len(jobs)} greedy requests: prompts of "
            "40-1200 characters, max_tokens 16-128, one in four chat, half streamed"
        ),
        "sequential": summary(singles),
        "concurrent": summary(togethers),
        "rounds": {
            "sequential": singles,
            "concurrent": togethers,
            "speedup": speedup,
            "latency_ratio": ratio,
        },
        "check": check(jobs, rounds),
        "targets": {
            "speedup": statistics.median(speedup),
            "speedup_met": statistics.median(speedup) >= 4,
            "latency_ratio": statistics.median(ratio),
            "latency_met": statistics.median(ratio) < 3,
            "latency_ratio_vs_median": statistics.median(vs_median),
        },
        "server_exit": exit_code,
        "answers": {
            f"round_{k + 1}": {
                "single": [_answer(a) for a in single.answers.values()],
                "concurrent": [_answer(a) for a in together.answers.values()],
            }
            for k, (single, together) in enumerate(rounds)
        },
    }


def _answer(a) -> dict:
    """An answer as the JSON keeps it: its event gaps are in the phase's figures, not listed."""
    return {k: v for k, v in asdict(a).items() if k not in ("gaps", "last")}


def _counters(c: dict) -> str:
    """The engine's counters from /metrics, as a sentence."""
    if not c:
        return "The server's /metrics held no prefix-cache or preemption counters."
    queries = c.get("onegpu_prefix_cache_queries", 0.0)
    hits = c.get("onegpu_prefix_cache_hits", 0.0)
    share = f" ({hits / queries:.1%})" if queries else ""
    return (
        f"The server's /metrics at the end (every round and the warm-up): prefix cache "
        f"{hits:.0f} of {queries:.0f} prompt tokens found{share}; "
        f"{c.get('onegpu_num_preemptions', 0.0):.0f} sequences preempted."
    )
