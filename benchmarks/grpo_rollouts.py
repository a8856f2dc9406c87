"""Which path samples GRPO rollouts fastest here: onegpu's decode engine or transformers'.

    python benchmarks/grpo_rollouts.py --rounds 5 --out benchmarks/results/grpo-rollouts-cpu

Paths, each sampling group_size completions per prompt with the default job's model shape (the
`tiny` preset, random weights, fp32): (e) onegpu's decode engine as GRPO's default sampler runs it
(``rollout.engine_rollouts``: eager, an engine per call, each prompt prefilled once), (f) the same
with its decode step compiled (a run that compiles: the engine kept across calls), (a) plain
``model.generate`` (dynamic cache), (b) static cache + torch.compile through ``generate``, (c)
transformers' continuous batching (``model.generate_batch``). Every path must produce exactly
``max_new_tokens`` per row (EOS is masked by ``min_new_tokens`` or disabled), so tokens/s compare
like with like. Rounds interleave the paths (a, b, c, a, b, c, ...); a path's first call is timed
apart (compilation, warm-up). Each path runs with torch's default intra-op threads (@2t on two
cores) and with one (@1t).
Writes <out>.json (every per-round number, machine, load, versions) and <out>.md (a table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

from onegpu.config.grpo import GRPOConfig
from onegpu.data.tokenizer import train_tokenizer
from onegpu.models import preset_config
from onegpu.objectives.rollout import engine_rollouts

BASE_PATHS = ("engine", "engine-compile", "generate", "static-compile", "continuous-batching")
# each path with torch's default intra-op threads and with one: a decode step's ops are small, and
# splitting them across threads can cost more than it saves (most of all on a shared machine)
DEFAULT_THREADS = torch.get_num_threads()
PATHS = tuple(f"{p}@{t}t" for p in BASE_PATHS for t in sorted({1, DEFAULT_THREADS}))


def stdlib_texts(max_files: int = 300) -> list[str]:
    """Standard library source (the default job's corpus) for the tokenizer and the prompts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:max_files]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def make_prompts(tok, texts: list[str], n: int, seed: int) -> list[list[int]]:
    """n prompts of 60-100 tokens, cut from different source files."""
    lengths = torch.randint(60, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [tok(texts[i * 37 % len(texts)][:4000])["input_ids"][:k] for i, k in enumerate(lengths)]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def gen_config(tok, args, path: str) -> GenerationConfig:
    # sampling as GRPO does it: temperature 1, no top-k / top-p truncation
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens)
    kw.update(num_return_sequences=args.group, pad_token_id=tok.pad_token_id)
    if path == "continuous-batching":
        # continuous batching drops min_new_tokens' processor (unsupported); -1 disables EOS there
        return GenerationConfig(**kw, eos_token_id=-1)
    kw.update(eos_token_id=tok.eos_token_id, min_new_tokens=args.new_tokens)
    if path == "generate":
        return GenerationConfig(**kw, disable_compile=True)
    # reduce-overhead means CUDA graphs (none on a CPU); off a GPU transformers compiles if asked
    cc = CompileConfig(mode="default", fullgraph=False, dynamic=False)
    cc._compile_all_devices = True
    return GenerationConfig(**kw, cache_implementation="static", compile_config=cc)


def run_once(model, tok, prompts, args, path: str) -> tuple[float, float, int]:
    """One batch of rollouts; returns (wall seconds, CPU seconds of all the process's threads,
    generated tokens), checking every row's length. CPU seconds suffer less from a busy machine."""
    rows = len(prompts) * args.group
    if path.startswith("engine"):
        return _engine_once(model, prompts, args, rows, compiled=path == "engine-compile")
    cfg = gen_config(tok, args, path)
    # Left unset, num_blocks and max_batch_tokens are sized from free memory: on a CPU that is the
    # host RAM (a 14 GB cache here), so size the paged cache for the batch: one page per row
    # suffices while prompt + completion <= page_size, plus a spare page per row.
    page = 256
    pages_per_row = -(-(max(map(len, prompts)) + args.new_tokens) // page)
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=rows * (pages_per_row + 1), max_batch_tokens=2048
    )
    t0, c0 = time.perf_counter(), time.process_time()
    if path == "continuous-batching":
        out = model.generate_batch(prompts, generation_config=cfg, continuous_batching_config=cb)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        errors = [r.error for r in out.values() if r.error]
        if errors:
            raise RuntimeError(f"continuous batching failed: {errors[0]}")
        lengths = [len(r.generated_tokens) for r in out.values()]
    else:
        ids, mask = left_pad(prompts, tok.pad_token_id)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        lengths = [out.shape[1] - ids.shape[1]] * out.shape[0]
    if len(lengths) != rows or set(lengths) != {args.new_tokens}:
        raise RuntimeError(f"{path}: {len(lengths)} rows of lengths {sorted(set(lengths))}")
    return secs, cpu, sum(lengths)


def _engine_once(model, prompts, args, rows: int, compiled: bool) -> tuple[float, float, int]:
    chunk = [p for p in prompts for _ in range(args.group)]
    gcfg = GRPOConfig(max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine_rollouts(model, chunk, gcfg, [-1], compiled)  # no EOS: all decode new_tokens
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    lengths = list(map(len, out))
    if len(lengths) != rows or set(lengths) != {args.new_tokens}:
        raise RuntimeError(f"engine: {len(lengths)} rows of lengths {sorted(set(lengths))}")
    return secs, cpu, sum(lengths)


def bench(model, tok, prompts, args) -> dict:
    """Interleaved rounds over the paths for one workload; a path that fails is recorded, once."""
    paths = args.paths.split(",") if args.paths else PATHS
    res = {
        p: dict(first_call_s=None, seconds=[], cpu_s=[], tokens=[], tok_per_s=[], load_1min=[])
        for p in paths
    }
    for rnd in range(-1, args.rounds):  # round -1: each path's first call (compile, warm-up)
        for p in paths:
            r = res[p]
            if r.get("error"):
                continue
            torch.manual_seed(args.seed + rnd)
            path, threads = p.split("@")
            torch.set_num_threads(int(threads[:-1]))
            try:
                secs, cpu, n = run_once(model, tok, prompts, args, path)
            except Exception as exc:  # noqa: BLE001 - recorded as the path's result
                r["error"] = f"{type(exc).__name__}: {exc}"
                r["traceback"] = traceback.format_exc(limit=-6)
                print(f"  {p}: FAILED {r['error']}")
                continue
            if rnd < 0:
                r["first_call_s"] = secs
            else:
                r["seconds"].append(secs)
                r["cpu_s"].append(cpu)
                r["tokens"].append(n)
                r["tok_per_s"].append(n / secs)
                r["load_1min"].append(round(os.getloadavg()[0], 2))
            print(f"  round {rnd:2d} {p:20s} {secs:6.2f}s {cpu:6.2f} cpu-s {n / secs:7.1f} tok/s")
    for r in res.values():
        for k in ("seconds", "cpu_s", "load_1min") if r["seconds"] else ():
            r[f"{k}_summary"] = dict(median=statistics.median(r[k]), min=min(r[k]), max=max(r[k]))
        if r["seconds"]:  # from the seconds (every batch has the same tokens), so both agree
            n, s = r["tokens"][0], r["seconds_summary"]
            r["tok_per_s_summary"] = dict(
                median=n / s["median"], min=n / s["max"], max=n / s["min"]
            )
    return res


def rng(x: dict, digits: int) -> str:
    return f"{x['median']:.{digits}f} [{x['min']:.{digits}f}-{x['max']:.{digits}f}]"


def write_md(path: Path, doc: dict) -> None:
    lines = [
        "# GRPO rollouts on CPU: which path samples fastest",
        "",
        f"{doc['date']}; `tiny` preset (random weights, fp32, vocab {doc['vocab']}), "
        f"{doc['new_tokens']} new tokens per completion (EOS masked or disabled), sampling T=1 "
        f"top_k=0 top_p=1; median [min-max] of {doc['rounds']} interleaved rounds; continuous "
        "batching with its paged cache sized for the batch (page 256, a spare page per row); "
        f"{doc['machine']['cpus']} CPUs, torch threads by default {doc['machine']['torch_threads']}"
        " (@Nt: N threads); "
        f"load average before/after {doc['load_before']} / {doc['load_after']} "
        "(near or above the CPU count: another job shared the cores). First call: with a cold "
        "compile cache.",
        "",
        "| workload | path | tokens/s | s/batch | CPU s/batch | load (1 min) | first call s |",
        "|---|---|---|---|---|---|---|",
    ]
    rank = {}  # workload -> [(median tokens/s, fastest round's tokens/s, path)]
    for name, res in doc["workloads"].items():
        for p, r in res.items():
            if r.get("error"):
                lines.append(f"| {name} | {p} | failed: {r['error'][:120]} | | | | |")
                continue
            cells = [rng(r[f"{k}_summary"], d) for k, d in (("tok_per_s", 0), ("seconds", 2))]
            cells += [rng(r["cpu_s_summary"], 2), rng(r["load_1min_summary"], 1)]
            lines.append(f"| {name} | {p} | {' | '.join(cells)} | {r['first_call_s']:.1f} |")
            rank.setdefault(name, []).append((*r["tok_per_s_summary"].values(), p))
    parts = []
    for name, rows in rank.items():
        for i, label in ((0, "median"), (2, "fastest round")):
            order = sorted(rows, key=lambda x: x[i], reverse=True)
            ratios = ", ".join(f"{order[0][i] / x[i]:.2f}x {x[-1]}" for x in order[1:])
            parts.append(f"{name}, {label}: **{order[0][-1]}** ({ratios})")
    lines += ["", "Conclusion, fastest path by tokens/s: " + "; ".join(parts) + "."]
    lines += ["", f"Versions: {doc['versions']}.", f"Command: `{doc['command']}`", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/grpo-rollouts-cpu")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompts", default="2,4", help="prompts per batch, one workload each")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", default="", help=f"comma-separated subset of {', '.join(PATHS)}")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as rounds finish

    load_before = os.getloadavg()
    # a cold compile cache, so static-compile's first call shows the whole compile time
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    texts = stdlib_texts()
    tok = train_tokenizer(texts, 4096, "grpo-rollouts-bench-stdlib-300")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(preset_config("tiny", tok)).eval()
    workloads, prompt_lengths = {}, {}
    for n in (int(x) for x in args.prompts.split(",")):
        name = f"{n} prompts x {args.group} ({n * args.group} rows)"
        prompts = make_prompts(tok, texts, n, args.seed)
        print(f"{name}; prompt lengths {[len(p) for p in prompts]}")
        workloads[name] = bench(model, tok, prompts, args)
        prompt_lengths[name] = [len(p) for p in prompts]
    doc = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command="python " + " ".join([sys.argv[0], *argv]),
        rounds=args.rounds,
        group=args.group,
        new_tokens=args.new_tokens,
        vocab=len(tok),
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            cpus=os.cpu_count(),
            torch_threads=DEFAULT_THREADS,
        ),
        versions=f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        prompt_lengths=prompt_lengths,
        workloads=workloads,
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    write_md(out.with_suffix(".md"), doc)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
