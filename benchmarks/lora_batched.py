"""Decode with LoRA adapters against decode without: the engine over a model with 3 adapters, its
requests spread over the base and the adapters, against the same base model alone (a base-only
server), the same requests; and the same 3-adapter engine with batched LoRA off (the policy row
``batched_lora``: PEFT routes each row, and every decode step runs eagerly). Eager engines and
compiled (inductor) ones, on two model shapes, the arms' runs interleaved round by round.

    python benchmarks/lora_batched.py --presets tiny,125m --rounds 5

Each engine decodes --batch rows at once (--prompt-token prompts, --new tokens, greedy); the
figure is decode tokens/s after every first token is out (engine_workloads.py's decode: ms per
decode step), median and range over the rounds. A compiled arm's first run (compiling) is not
timed. Writes benchmarks/results/lora-batched-cpu.{json,md}.
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

ADAPTERS = {"one": 8, "two": 16, "three": 32}  # name -> rank
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# arm -> (adapters loaded, policy rows off)
ARMS = {
    "base only": (False, []),
    "3 adapters, batched LoRA": (True, []),
    "3 adapters, PEFT routing (batched_lora off)": (True, ["batched_lora"]),
}


def with_adapters(model):
    """``model`` with the three adapters loaded, their weights random (a trained adapter's B is
    not PEFT's zeros)."""
    import peft

    torch.manual_seed(1)
    first, *rest = ADAPTERS.items()
    cfg = peft.LoraConfig(r=first[1], target_modules=TARGETS, init_lora_weights=False)
    model = peft.get_peft_model(model, cfg, adapter_name=first[0])
    for name, rank in rest:
        cfg = peft.LoraConfig(r=rank, target_modules=TARGETS, init_lora_weights=False)
        model.add_adapter(name, cfg)
    return model.eval()


def run(eng, prompts, names, new: int) -> tuple[float, list]:
    """Decode tokens/s after every first token is out, and each request's tokens."""
    pairs = zip(prompts, names, strict=True)
    got = drive(eng, {eng.submit(p, params(new), a): i for i, (p, a) in enumerate(pairs)})
    everyone = max(r["first"] for r in got.values())
    done = max(r["times"][-1] for r in got.values())
    out_by = min(
        sum(n for t, n in zip(r["times"], r["counts"], strict=True) if t <= everyone)
        for r in got.values()
    )
    steps = new - out_by
    return len(prompts) * steps / (done - everyone), [r["tokens"] for r in got.values()]


def measure(preset: str, mode: str, args) -> dict:
    context = args.prompt + args.new
    rng = random.Random(0)
    prompts = [tokens(rng, args.prompt) for _ in range(args.batch)]
    spread_names = ["__base__", *ADAPTERS]
    names = [spread_names[i % len(spread_names)] for i in range(args.batch)]
    plain, lora = make_model(preset, 1024), with_adapters(make_model(preset, 1024))
    engines, answers, asked = {}, {}, {}
    for arm, (loaded, off) in ARMS.items():
        started = time.perf_counter()
        config = {"max_slots": args.batch, "max_len": context, "compile": mode, "policy_off": off}
        engines[arm] = engine(lora if loaded else plain, config)
        asked[arm] = names if loaded else [None] * args.batch
        _, answers[arm] = run(engines[arm], prompts, asked[arm], args.new)  # compiles
        took = time.perf_counter() - started
        print(f"{preset} {mode} {arm}: warm in {took:.0f} s", flush=True)
    runs = {arm: [] for arm in engines}
    for _ in range(args.rounds):
        for arm, eng in engines.items():
            runs[arm].append(run(eng, prompts, asked[arm], args.new)[0])
        print(f"{preset} {mode}: {[round(r[-1], 1) for r in runs.values()]}", flush=True)
    batched, routed = (answers[a] for a in list(ARMS)[1:])
    compiled = {a: e.stats().compiles for a, e in engines.items()}
    return {
        "runs": runs,
        "summary": {k: spread(v) for k, v in runs.items()},
        "same_tokens_batched_and_peft": batched == routed,
        "adapters_change_tokens": batched != answers["base only"],
        "compiled_steps": compiled,
    }


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        "# Decode with 3 LoRA adapters against the base model alone (CPU)",
        "",
        provenance.markdown(r),
        f"{r['threads']} torch thread(s).",
        "",
        f"{a['batch']} rows decode at once: {a['prompt']}-token prompts, {a['new']} new tokens, "
        "greedy, fp32. With adapters the rows are spread over the base and adapters of rank "
        f"{', '.join(map(str, ADAPTERS.values()))} on every linear layer ({', '.join(TARGETS)}). "
        "Base only: the same base weights, no PEFT wrapper, every request on the base. Decode "
        f"tokens/s after every first token is out, median (min-max) over {a['rounds']} "
        "interleaved rounds; the ratio is base only's median over the arm's (how many times "
        "slower; the target: within 1.3). A compiled arm runs inductor; with batched LoRA off the "
        "adapters' steps run eagerly whatever the setting (PEFT's per-row hooks).",
        "",
    ]
    for key, res in r["results"].items():
        lines += [f"## {key}", "", "| arm | decode tokens/s | base only / arm |", "|---|---|---|"]
        base = res["summary"]["base only"]["median"]
        for arm, s in res["summary"].items():
            lines.append(
                f"| {arm} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) | "
                f"{base / s['median']:.2f} |"
            )
        lines += [
            "",
            f"greedy tokens of batched LoRA equal PEFT routing's: "
            f"{res['same_tokens_batched_and_peft']}; the adapters change the tokens: "
            f"{res['adapters_change_tokens']}; decode steps compiled (first run): "
            f"{res['compiled_steps']}",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,125m")
    ap.add_argument("--modes", default="off,on", help="compile settings: off (eager), on")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/lora-batched-cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    head, results = provenance.begin(), {}
    out = ROOT / args.out
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            label = "compiled (inductor)" if mode == "on" else "eager"
            with torch.no_grad():
                results[f"{preset}, {label}"] = measure(preset, mode, args)
            result = {
                **provenance.end(head),
                "threads": args.threads,
                "args": vars(args),
                "results": results,
            }
            out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
