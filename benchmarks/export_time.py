"""Export time and peak memory: `onegpu export --format gguf --quant f16` (with its check and
without) beside the route Unsloth documents for doing it by hand, as a user types it: merge with
PEFT's merge_and_unload + save_pretrained, then llama.cpp's convert_hf_to_gguf.py (from the
llama-cpp-python sdist) --outtype f16. Sources: the `125m` preset (random weights, the default
job's 4096-token tokenizer; nothing to merge) and a rank-16 LoRA over it on every linear layer
(non-zero, merged). Each route runs in a fresh process whose children are its steps; time is its
wall clock; memory both the largest peak RSS of any one of its processes and the peak of the sum
over its process tree (sampled every 0.1 s). Routes interleaved per round; median and range.

By hand, llama.cpp's converter stops on a tokenizer onegpu trained ("BPE pre-tokenizer was not
recognized"); its error tells the user to register the tokenizer's hash, which the hand route does
in its own copy of the converter (one line naming the hash and `gpt-2`), as a user following that
error would.

    ONEGPU_LLAMA_CPP_DIR=~/.cache/onegpu/llama-cpp/0.3.36 PYTHONPATH=src \
        python benchmarks/export_time.py --rounds 5 --out benchmarks/results/export-time-cpu
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from hashlib import sha256
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
ARMS = ("onegpu", "onegpu+check", "hand")
MERGE = """
import sys
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
base, adapter, out = sys.argv[1:4]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
model.merge_and_unload().save_pretrained(out)
AutoTokenizer.from_pretrained(base).save_pretrained(out)
"""


def route_steps(arm: str, src: Path, adapter: Path | None, out: Path, hand: Path) -> list:
    py = sys.executable
    if arm.startswith("onegpu"):
        cmd = [py, "-m", "onegpu", "export", str(src), "--format", "gguf", "--quant", "f16"]
        cmd += ["--output", str(out), "--check", "on" if arm == "onegpu+check" else "off"]
        return [cmd + (["--adapter", str(adapter)] if adapter else [])]
    merged = out / "merged"
    steps = [[py, "-c", MERGE, str(src), str(adapter), str(merged)]] if adapter else []
    convert = [py, str(hand / "convert_hf_to_gguf.py"), str(merged if adapter else src)]
    return [*steps, [*convert, "--outtype", "f16", "--outfile", str(out / "model-f16.gguf")]]


def run_route(steps: list[list[str]]) -> dict:
    """Each step a child of this process: the wall time, the largest single peak RSS, and the
    peak of the process tree's summed RSS."""
    import psutil

    start, tree_peak = time.perf_counter(), 0
    for cmd in steps:
        with tempfile.TemporaryFile("w+") as err:  # a file: the converter's log fills no pipe
            child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
            while child.poll() is None:
                tree_peak = max(tree_peak, _tree_rss(psutil.Process(child.pid)))
                time.sleep(0.1)
            if child.returncode:
                err.seek(0)
                raise SystemExit(f"step failed: {cmd[:4]}...\n{err.read()[-3000:]}")
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "tree_peak_mib": tree_peak / 2**20,
        "load1": os.getloadavg()[0],
    }


def _tree_rss(proc) -> int:
    import psutil

    try:
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs)
    except psutil.Error:  # a step ended between the listing and the reading
        return 0


def prepare(work: Path) -> dict:
    """The 125m preset and a LoRA adapter over it; the hand route's converter copy."""
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
    base = llama_dir / "conversion" / "base.py"
    text = base.read_text(encoding="utf-8")
    chktxt = ast.literal_eval(text.split("chktxt = ", 1)[1].split("\n", 1)[0])
    chkhsh = sha256(str(tok.encode(chktxt)).encode()).hexdigest()
    anchor = "        res = None\n"
    assert anchor in text, "the converter's pre-tokenizer table moved"
    line = f'        if chkhsh == "{chkhsh}":\n            res = "gpt-2"\n'
    base.write_text(text.replace(anchor, anchor + line, 1), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--out", default="")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one route
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_route(json.loads(args.one))))
        return 0
    from onegpu.bench import provenance

    head, results = provenance.begin(), {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        setup = prepare(work)
        sources = {"125m": None, "125m + LoRA r16": setup["adapter"]}
        for r in range(args.rounds):
            for name, adapter in sources.items():
                for arm in args.arms:
                    out = work / f"out-{r}-{arm}"
                    out.mkdir() if arm == "hand" else None
                    steps = route_steps(arm, setup["base"], adapter, out, setup["hand"])
                    cmd = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--one",
                        json.dumps(steps),
                    ]
                    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if done.returncode:
                        raise SystemExit(done.stderr[-3000:])
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    got["gguf_mib"] = next(out.rglob("model-f16.gguf")).stat().st_size / 2**20
                    results.setdefault(f"{name} | {arm}", []).append(got)
                    print(f"round {r + 1} {name} {arm}: {got}", flush=True)
                    shutil.rmtree(out)
            if args.out:  # after every round: a slow machine's partial run still tells
                write(Path(args.out), head, results, r + 1)
    return 0


def summary(xs: list[float], spec: str = ",.1f") -> str:
    """Median [min-max] (onegpu.bench.timing's helpers)."""
    from onegpu.bench.timing import median, span

    lo, hi = span(xs)
    return f"{median(xs):{spec}} [{lo:{spec}}-{hi:{spec}}]"


def table(results: dict) -> str:
    rows = [
        "| source | route | seconds | ÷ hand (per round) | largest process MiB "
        "| process tree MiB |",
        "|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        name = key.split(" | ")[0]
        hand = results.get(f"{name} | hand", [])
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs, hand, strict=False)]
        cols = [summary([x[m] for x in runs]) for m in ("seconds", "peak_rss_mib", "tree_peak_mib")]
        ratio = summary(ratios, ".2f")
        rows.append(f"| {key} | {cols[0]} | {ratio} | {cols[1]} | {cols[2]} |")
    return "\n".join(rows)


def write(out: Path, head: dict, results: dict, rounds: int) -> None:
    from onegpu.bench import provenance

    doc = {**provenance.end(head), "rounds": rounds, "per_round": results}
    loads = [x["load1"] for runs in results.values() for x in runs]
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        "# Export time and peak memory: onegpu export beside the hand route (CPU)\n\n"
        + provenance.markdown(doc)
        + f"\n{rounds} interleaved rounds (per round and source: "
        + ", ".join(dict.fromkeys(k.split(" | ")[1] for k in results))
        + f"); 1-minute load after each route {min(loads):.1f} to {max(loads):.1f}. "
        "Medians [min-max]; the ratio is each round's onegpu time over the same round's hand "
        "time.\n\n" + table(results) + "\n"
    )
    print(out.with_suffix(".md").read_text(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
