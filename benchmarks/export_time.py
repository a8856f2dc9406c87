"""Export time and peak memory: `onegpu export --format gguf --quant q8_0` beside the route
Unsloth documents for doing it by hand (merge with PEFT's merge_and_unload + save_pretrained, then
llama.cpp's convert_hf_to_gguf.py to f16, then llama.cpp's quantizer to q8_0), as a user types
them. Two sources: the `125m` preset (a whole model, nothing to merge) and a LoRA run over it (a
rank-16 adapter on every linear layer, non-zero, merged). Each route runs in a fresh process whose
children are its steps; the time is the route's wall clock, the memory the largest peak RSS of any
of its processes. Routes interleaved per round; median and range.

By hand, llama.cpp's converter stops on a tokenizer onegpu trained ("BPE pre-tokenizer was not
recognized"): its error tells the user to register the tokenizer's hash, which the hand route here
does in its own copy of the converter (one line naming the hash and `gpt-2`, the pre-tokenizer
onegpu proves for it), as a user following that error would.

    ONEGPU_LLAMA_CPP_DIR=~/.cache/onegpu/llama-cpp/0.3.36 PYTHONPATH=src \
        python benchmarks/export_time.py --rounds 5 --out benchmarks/results/export-time-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

MERGE = """
import sys
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base)
model = PeftModel.from_pretrained(model, adapter)
model = model.merge_and_unload()
model.save_pretrained(out)
AutoTokenizer.from_pretrained(base).save_pretrained(out)
"""
# what llama.cpp's llama-quantize tool calls (llama-cpp-python ships the library, not the tool)
QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
src, dst = (a.encode() for a in sys.argv[1:3])
sys.exit(llama_cpp.llama_model_quantize(src, dst, llama_cpp.byref(p)))
"""


def route_steps(arm: str, src: Path, adapter: Path | None, out: Path, hand_llama: Path):
    py = sys.executable
    if arm.startswith("onegpu"):
        cmd = [py, "-m", "onegpu", "export", str(src), "--format", "gguf", "--quant", "q8_0"]
        cmd += ["--output", str(out), "--check", "on" if arm == "onegpu+check" else "off"]
        return [cmd + (["--adapter", str(adapter)] if adapter else [])]
    merged = out / "merged"
    steps = [[py, "-c", MERGE, str(src), str(adapter), str(merged)]] if adapter else []
    f16, q8 = out / "model-f16.gguf", out / "model-q8_0.gguf"
    convert = [py, str(hand_llama / "convert_hf_to_gguf.py"), str(merged if adapter else src)]
    steps.append([*convert, "--outtype", "f16", "--outfile", str(f16)])
    steps.append([py, "-c", QUANTIZE, str(f16), str(q8)])
    return steps


def run_route(steps: list[list[str]]) -> dict:
    """In this (fresh) process: each step a child; wall time and the largest peak RSS."""
    start = time.perf_counter()
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"step failed: {cmd[:4]}...\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    peak = max(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    )
    return {"seconds": seconds, "peak_rss_mib": peak / 1024}


def prepare(work: Path) -> dict:
    """The 125m preset (random weights, the default job's tokenizer) and a LoRA adapter over it;
    the hand route's copy of llama.cpp's converter with the tokenizer's hash registered."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from onegpu.data.records import stdlib_source
    from onegpu.data.tokenizer import train_tokenizer
    from onegpu.export.llama_setup import converter_dir
    from onegpu.models import preset_config

    files = stdlib_source(1_500_000, 0.0).train_files
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    tok = train_tokenizer(texts, 4096, "export-time-stdlib-1.5mb")
    torch.manual_seed(0)
    base = work / "base-125m"
    LlamaForCausalLM(preset_config("125m", tok)).save_pretrained(str(base))
    tok.save_pretrained(str(base))
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(str(base)), lora)
    peft.save_pretrained(str(work / "lora-125m"))
    hand = work / "llama.cpp"
    shutil.copytree(converter_dir(), hand)
    register_hash(hand, tok)
    return {"base": base, "adapter": work / "lora-125m", "hand": hand}


def register_hash(llama_dir: Path, tok) -> None:
    """What the converter's error asks of a user: the tokenizer's hash mapped to a pre-tokenizer."""
    from hashlib import sha256

    base = llama_dir / "conversion" / "base.py"
    text = base.read_text(encoding="utf-8")
    chktxt = text.split("chktxt = ", 1)[1].split("\n", 1)[0]
    import ast

    chkhsh = sha256(str(tok.encode(ast.literal_eval(chktxt))).encode()).hexdigest()
    anchor = "        res = None\n"
    assert anchor in text, "the converter's pre-tokenizer table moved"
    line = f'        if chkhsh == "{chkhsh}":\n            res = "gpt-2"\n'
    base.write_text(text.replace(anchor, anchor + line, 1), encoding="utf-8")


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=["onegpu", "hand"])
    ap.add_argument("--out", default="")
    ap.add_argument("--one", nargs="*", help=argparse.SUPPRESS)  # internal: run one route
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_route(json.loads(args.one[0]))))
        return 0
    from onegpu.bench import provenance

    head = provenance.begin()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        setup = prepare(work)
        sources = {
            "125m": (setup["base"], None),
            "125m + LoRA r16": (setup["base"], setup["adapter"]),
        }
        for r in range(args.rounds):
            for name, (src, adapter) in sources.items():
                for arm in args.arms:
                    out = work / f"out-{r}-{arm}"
                    out.mkdir() if arm == "hand" else None
                    steps = route_steps(arm, src, adapter, out, setup["hand"])
                    done = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(steps)],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                    )
                    if done.returncode:
                        raise SystemExit(done.stderr[-3000:])
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    q8 = next(out.rglob("model-q8_0.gguf"))
                    got["gguf_mib"] = q8.stat().st_size / 2**20
                    results.setdefault(f"{name} | {arm}", []).append(got)
                    print(f"round {r + 1} {name} {arm}: {got}", flush=True)
                    shutil.rmtree(out)
            if args.out:  # after every round: a slow machine's partial run still tells
                write(Path(args.out), head, results, r + 1)
    if not args.out:
        print(lines(results))
    return 0


def lines(results: dict) -> str:
    table = {k: {m: summary([x[m] for x in v]) for m in v[0]} for k, v in results.items()}
    rows = [
        "| source | route | seconds (median [min-max]) | peak RSS MiB (median [min-max]) "
        "| q8_0 GGUF MiB |",
        "|---|---|---|---|---|",
    ]
    for key, t in table.items():
        s, m, g = t["seconds"], t["peak_rss_mib"], t["gguf_mib"]
        rows.append(
            f"| {key} | {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] | "
            f"{m['median']:,.0f} [{m['min']:,.0f}-{m['max']:,.0f}] | {g['median']:,.0f} |"
        )
    return "\n".join(rows)


def write(out: Path, head: dict, results: dict, rounds: int) -> None:
    from onegpu.bench import provenance

    doc = {**provenance.end(head), "rounds": rounds, "per_round": results}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        "# Export time and peak memory: onegpu export beside the hand route (CPU)\n\n"
        + provenance.markdown(doc)
        + f"\n{rounds} interleaved rounds.\n\n"
        + lines(results)
        + "\n"
    )
    print(out.with_suffix(".md").read_text(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
