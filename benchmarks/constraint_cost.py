"""What structured output costs the decode engine per token, on this CPU with one torch thread.

    python benchmarks/constraint_cost.py --rounds 7 --out benchmarks/results/constraint-cost-cpu

A batch of 8 rows of the `tiny` preset (random weights, fp32, a 32k-token byte-level BPE trained
here on the standard library's source), the engine eager (its default off a GPU), greedy, 64 new
tokens a row (EOS ignored), with 0, 1 or 8 rows constrained by a JSON schema whose answers cannot
end within the limit (an array of at least 100 objects), so every row makes all 64 tokens in every
arm. Arms, interleaved each round:

- ``0 of 8``: no grammar; the engine reads back every ``sync_every`` (8) tokens
- ``0 of 8, sync_every 1``: no grammar, a read-back after every token (what a grammar forces on
  its batch), to part the read-back's cost from the mask's
- ``1 of 8`` and ``8 of 8``: rows under the schema

The time is per decode step of the batch (one token a row), after the step that computes the
prompts (the grammars compile there, at admission); ms of wall clock and of this process's CPU.
Only the engine's public API is used: the host's share of a constrained step (the masks' fill,
the matchers' advance), which results/constraint-cost-cpu.md timed apart at its commit, needs a
figure the engine's stats do not give. Writes <out>.json and <out>.md (the results header:
command, commit, date, machine, load)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from onegpu.bench import provenance
from onegpu.data.tokenizer import train_tokenizer
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import Constraint, SamplingParams
from onegpu.models import preset_config

ROWS, VOCAB = 8, 32000
# the schema the grammar libraries were compared on (results/grammar-libs-cpu.md)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 100}},
    "required": ["people"],
    "additionalProperties": False,
}
ARMS = {"0 of 8": (0, 8), "0 of 8, sync_every 1": (0, 1), "1 of 8": (1, 1), "8 of 8": (8, 1)}


def stdlib_texts(max_files: int = 300):
    """The standard library's source, read as the tokenizer trains (nothing read when cached)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(root.glob("*.py"))[:max_files]:
        yield p.read_text(encoding="utf-8", errors="replace")


def prompts(tok, n: int, length: int = 32) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    return [tok(files[i * 7].read_text()[:2000])["input_ids"][:length] for i in range(n)]


def make_engine(model, tok, sync_every: int) -> Engine:
    return Engine(model, tok, EngineConfig(max_slots=ROWS, max_len=256, sync_every=sync_every))


def run(
    engine: Engine, ids: list[list[int]], constrained: int, new: int, biased: int = 0, bias=()
) -> dict:
    """One batch to its end: ms (wall, CPU) per decode step after the prompts' step; the first
    ``constrained`` rows under the schema, the first ``biased`` with ``bias`` as logit_bias."""
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    for i, p in enumerate(ids):
        params = SamplingParams(
            max_new_tokens=new,
            ignore_eos=True,
            logit_bias=bias if i < biased else (),
            constraint=schema if i < constrained else None,
        )
        engine.submit(p, params)
    engine.step()  # the prompts, the first tokens, the grammars compiled
    wall, cpu, made = time.perf_counter(), time.process_time(), 0
    while engine.has_work():
        for u in engine.step():
            made += len(u.token_ids)
            if u.finished and u.finish_reason != "length":
                raise RuntimeError(f"a row ended before its limit: {u.finish_reason} {u.error}")
    steps = new - 1
    assert made == ROWS * steps, made
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"ms_per_token": 1e3 * wall / steps, "cpu_ms_per_token": 1e3 * cpu / steps}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/constraint-cost-cpu")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(1)
    head = provenance.begin()
    started = time.perf_counter()
    tok = train_tokenizer(stdlib_texts(), VOCAB, "constraint-cost-stdlib-300")
    torch.manual_seed(0)
    model = preset_model(tok)
    ids = prompts(tok, ROWS)
    engines = {arm: make_engine(model, tok, sync) for arm, (_, sync) in ARMS.items()}
    with torch.no_grad():
        for arm, (constrained, _) in ARMS.items():  # warm-up: one short batch each, untimed
            run(engines[arm], ids, constrained, 8)
        rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm, (constrained, _) in ARMS.items():
                rounds[arm].append(run(engines[arm], ids, constrained, args.new_tokens))
            line = ", ".join(f"{a} {v[-1]['ms_per_token']:.2f}" for a, v in rounds.items())
            print(f"round {r + 1}: ms/token {line}")
    results = {
        arm: {k: summary([x[k] for x in runs]) for k in runs[0]} for arm, runs in rounds.items()
    }
    doc = {
        **provenance.end(head),
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": ROWS,
        "vocab": model.config.vocab_size,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "prompt_lengths": [len(p) for p in ids],
        "results": results,
        "per_round": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(markdown(doc))
    print(out.with_suffix(".md").read_text())
    return 0


def preset_model(tok):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(preset_config("tiny", tok)).eval()


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "llguidance")}


def markdown(doc: dict) -> str:
    res = doc["results"]
    base = res["0 of 8"]["ms_per_token"]["median"]

    def cell(s: dict) -> str:
        return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    lines = [
        "# Structured output's cost per token (CPU, one thread)",
        "",
        provenance.markdown(doc),
        f"- torch threads: {doc['torch_threads']}",
        f"- versions: {doc['versions']}",
        f"- run: {doc['seconds']} s",
        "",
        f"`tiny` preset, random weights, fp32, vocabulary {doc['vocab']}; {doc['rows']} rows, "
        f"prompts of {min(doc['prompt_lengths'])}-{max(doc['prompt_lengths'])} tokens, "
        f"{doc['new_tokens']} new tokens a row (EOS ignored), greedy, the engine eager; "
        f"median [min-max] of {doc['rounds']} interleaved rounds, per decode step of the "
        "batch (one token a row), after the prompts' step.",
        "",
        "| rows constrained | ms/token | CPU ms/token | vs 0 of 8 |",
        "|---|---|---|---|",
    ]
    for arm, r in res.items():
        ratio = r["ms_per_token"]["median"] / base
        lines.append(
            f"| {arm} | {cell(r['ms_per_token'])} | {cell(r['cpu_ms_per_token'])} | {ratio:.2f}x |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
