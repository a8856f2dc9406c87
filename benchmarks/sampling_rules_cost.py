"""What a grammar and logit_bias cost the decode engine per step, on two model shapes, this CPU,
one torch thread.

    python benchmarks/sampling_rules_cost.py --rounds 5 \
        --out benchmarks/results/sampling-rules-cost-cpu

8 rows of the ``tiny`` and ``125m`` presets (random weights, fp32, the 32k-token BPE of
constraint_cost.py), the engine eager (its default off a GPU), greedy, 48 new tokens a row (EOS
ignored). Arms, interleaved each round within a shape:

- ``plain``: no rule, a read-back every 8 tokens (the default)
- ``plain, sync_every 1``: a read-back after every token (what a grammar forces on its batch)
- ``logit_bias 1 of 8`` / ``8 of 8``: rows with 16 biased tokens each (values within +-2, so
  the answer goes on); the add runs over the whole batch either way
- ``grammar 1 of 8`` / ``8 of 8``: rows under constraint_cost.py's schema (no end within the limit)

The time is per decode step of the batch (one token a row), after the prompts' step; wall clock
and this process's CPU. Writes <out>.json and <out>.md (command, commit, date, machine,
``uptime`` before and after)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import constraint_cost  # noqa: E402 - its batch loop
from constraint_cost import (  # noqa: E402 - its tokenizer, prompts and schema
    VOCAB,
    _versions,
    prompts,
    stdlib_texts,
)

from onegpu.bench import provenance  # noqa: E402
from onegpu.data.tokenizer import train_tokenizer  # noqa: E402
from onegpu.infer.constraints import Grammars  # noqa: E402
from onegpu.infer.engine import Engine, EngineConfig  # noqa: E402
from onegpu.models import preset_config  # noqa: E402

ROWS = 8
SHAPES = ("tiny", "125m")
# arm: (sync_every, rows biased, rows constrained)
ARMS = {
    "plain": (8, 0, 0),
    "plain, sync_every 1": (1, 0, 0),
    "logit_bias 1 of 8": (8, 1, 0),
    "logit_bias 8 of 8": (8, 8, 0),
    "grammar 1 of 8": (1, 0, 1),
    "grammar 8 of 8": (1, 0, 8),
}
BIAS = tuple((t, (-1.5, 2.0)[t % 2]) for t in range(1000, 17000, 1000))


def run(engine: Engine, ids, biased: int, constrained: int, new: int) -> dict:
    """constraint_cost's batch with the first ``biased`` rows under BIAS, per decode step."""
    r = constraint_cost.run(engine, ids, constrained, new, biased, BIAS)
    return {"ms_per_step": r["ms_per_token"], "cpu_ms_per_step": r["cpu_ms_per_token"]}


def stage(rounds: int, reps: int = 200) -> dict:
    """The sampler's stage alone (``sampling.next_tokens``, greedy, eager) over [8, vocab] fp32
    logits, at the tiny presets' 32,000 and Llama 3's 128,256 tokens: µs per call with nothing,
    with logit_bias (every row's bias added, min_tokens' EOS mask), with a grammar's mask on 1 and
    on 8 rows (its unpack and apply; the host's fill is the whole-step table's). Interleaved."""
    from onegpu.infer.sampling import next_tokens

    out = {}
    for vocab in (32000, 128256):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(ROWS, vocab, generator=g)
        z = torch.zeros(ROWS)
        bias = torch.zeros(ROWS, vocab)
        bias[:, 1000:17000:1000] = 1.5
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (ROWS, words), dtype=torch.int32, generator=g)
        eos = torch.tensor([2])

        def params(masked_rows: int = 0, t=(z, bitmask, bias, eos)):
            return _row_params(*t, masked_rows)

        arms = {
            "greedy, nothing": (params(), {}),
            "logit_bias + min_tokens": (params(), {"biased": True}),
            "grammar mask 1 of 8": (params(1), {"constraints": True}),
            "grammar mask 8 of 8": (params(8), {"constraints": True}),
        }
        times: dict[str, list[float]] = {a: [] for a in arms}
        cpu: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(rounds):
            for arm, (p, kw) in arms.items():
                next_tokens(logits, p, False, False, False, **kw)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    next_tokens(logits, p, False, False, False, **kw)
                times[arm].append(1e6 * (time.perf_counter() - t0) / reps)
                # this process's CPU time: a loaded machine stretches the wall clock of a call
                # (waits for a core) more than the CPU time the call needs
                cpu[arm].append(1e6 * (time.process_time() - c0) / reps)
        out[vocab] = {a: {**summary(v), "cpu": summary(cpu[a])} for a, v in times.items()}
    return out


def _row_params(z, bitmask, bias, eos, masked_rows: int):
    from onegpu.infer.sampling import RowParams

    masked = torch.arange(ROWS) < masked_rows
    return RowParams(
        z, z.long(), z + 1, z + 1, z.long(), z.long(), None, None, None, None,
        bitmask, masked, bias, torch.full((ROWS,), 4), eos,
    )  # fmt: skip


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new_tokens", type=int, default=48)
    ap.add_argument("--out", default="benchmarks/results/sampling-rules-cost-cpu")
    ap.add_argument("--stage", action="store_true", help="the sampler's stage alone (stage())")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(1)
    if args.stage:
        return stage_report(args, argv)
    before, started = provenance.uptime(), time.perf_counter()
    tok = train_tokenizer(stdlib_texts(), VOCAB, "constraint-cost-stdlib-300")
    ids = prompts(tok, ROWS)
    grammars = Grammars(tok, VOCAB)
    results, per_round, uptimes = {}, {}, {}
    from transformers import LlamaForCausalLM

    for shape in SHAPES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(preset_config(shape, tok)).eval()
        engines = {}
        for arm, (sync, _, _) in ARMS.items():
            cfg = EngineConfig(max_slots=ROWS, max_len=256, sync_every=sync)
            engines[arm] = Engine(model, tok, cfg)
            engines[arm].guides.grammars = grammars  # prepared once, as a server shares its own
        rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        with torch.no_grad():
            for arm, (_, b, c) in ARMS.items():  # warm-up: one short batch each, untimed
                run(engines[arm], ids, b, c, 8)
            for r in range(args.rounds):
                for arm, (_, b, c) in ARMS.items():
                    rounds[arm].append(run(engines[arm], ids, b, c, args.new_tokens))
                line = ", ".join(f"{a} {v[-1]['ms_per_step']:.2f}" for a, v in rounds.items())
                print(f"{shape} round {r + 1}: ms/step {line}")
        results[shape] = {
            arm: {k: summary([x[k] for x in runs]) for k in runs[0]} for arm, runs in rounds.items()
        }
        per_round[shape] = rounds
        uptimes[shape] = provenance.uptime()
        del engines, model
    doc = {
        "command": "python " + " ".join(["benchmarks/sampling_rules_cost.py", *argv]),
        "commit": provenance.commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{torch.get_num_threads()} torch thread, {__import__('os').cpu_count()} cores",
        "versions": _versions(),
        "uptime_before": before,
        "uptime_after_each_shape": uptimes,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": ROWS,
        "vocab": VOCAB,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "results": results,
        "per_round": per_round,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))
    print(out.with_suffix(".md").read_text())
    return 0


def stage_report(args, argv) -> int:
    before, started = provenance.uptime(), time.perf_counter()
    res = stage(args.rounds)
    lines = [
        "# The sampler's stage alone: logit_bias and a grammar's mask (CPU, one thread)",
        "",
        f"- command: `python benchmarks/sampling_rules_cost.py {' '.join(argv)}`",
        f"- commit: {provenance.commit()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: x86_64, 1 torch thread, {__import__('os').cpu_count()} cores",
        f"- uptime_before: {before}",
        f"- uptime_after: {provenance.uptime()}",
        f"- run: {time.perf_counter() - started:.1f} s",
        "",
        f"`sampling.next_tokens`, greedy, eager, on [{ROWS}, vocab] fp32 logits; µs per call "
        f"(wall clock, and this process's CPU time), median [min-max] of {args.rounds} "
        "interleaved rounds of 200 calls.",
        "",
        "| vocab | arm | µs/call | CPU µs/call | vs nothing (wall) |",
        "|---|---|---|---|---|",
    ]

    def cell(s: dict) -> str:
        return f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]"

    for vocab, arms in res.items():
        base = arms["greedy, nothing"]["median"]
        for arm, s in arms.items():
            ratio = s["median"] / base
            lines.append(f"| {vocab} | {arm} | {cell(s)} | {cell(s['cpu'])} | {ratio:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"results": res}, indent=1))
    out.with_suffix(".md").write_text("\n".join([*lines, ""]))
    print(out.with_suffix(".md").read_text())
    return 0


def markdown(doc: dict) -> str:
    def cell(s: dict) -> str:
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    lines = [
        "# A grammar's and logit_bias's cost per decode step (CPU, one thread)",
        "",
        f"- command: `{doc['command']}`",
        f"- commit: {doc['commit']}",
        f"- date: {doc['date']}",
        f"- machine: x86_64, {doc['machine']}",
        f"- versions: {doc['versions']}",
        f"- uptime_before: {doc['uptime_before']}",
        *[f"- uptime after {s}: {u}" for s, u in doc["uptime_after_each_shape"].items()],
        f"- run: {doc['seconds']} s",
        "",
        f"Random weights, fp32, vocabulary {doc['vocab']}; {doc['rows']} rows, "
        f"{doc['new_tokens']} new tokens a row (EOS ignored), greedy, the engine eager; median "
        f"[min-max] of {doc['rounds']} interleaved rounds, ms per decode step of the batch (one "
        "token a row), after the prompts' step.",
        "",
    ]
    for shape, res in doc["results"].items():
        base = res["plain"]["ms_per_step"]["median"]
        lines += [
            f"## `{shape}`",
            "",
            "| arm | ms/step | CPU ms/step | vs plain |",
            "|---|---|---|---|",
        ]
        for arm, r in res.items():
            ratio = r["ms_per_step"]["median"] / base
            lines.append(
                f"| {arm} | {cell(r['ms_per_step'])} | {cell(r['cpu_ms_per_step'])} | "
                f"{ratio:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
