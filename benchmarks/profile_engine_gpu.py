"""Where a decode step of onegpu's engine spends its time on a GPU: host, kernels, attention.

    python benchmarks/profile_engine_gpu.py --out DIR       # 1b preset, bf16, batch 1 and 8
    python benchmarks/profile_engine_gpu.py --out DIR --parts engine --batch 1 \
        --variants reductions,cublas
    python benchmarks/profile_engine_gpu.py --summarize DIR/trace-b1.json.gz --steps 16

Parts (``--parts``, default all), each printed as a markdown table, timed on CUDA graphs so no
launch cost is counted:

- ``attention``: decode attention alone at the engine's shapes (the 1b preset: 32 query heads over
  8 key/value heads of 64; a KV cache of prompt + new tokens, rows halfway through): transformers'
  ``repeat_kv`` + SDPA with a bool mask, the engine's grouped queries (``gqa_attention``), SDPA's
  own ``enable_gqa``, FlexAttention's decoding kernel (compiled; a block mask from each row's
  length), and SDPA's flash kernel over the valid keys without a mask (a floor).
- ``gemv``: each matmul shape of the 1b preset's layers at 1 and 8 rows: cuBLAS against
  ``small_gemv``'s reduction.
- ``argmax``: the sampler's greedy argmax over the vocabulary, compiled: inductor's argmax against
  ``sampling.first_argmax``.
- ``engine``: the engine, compiled (CUDA graphs), with its matmuls as each of ``--variants`` says
  (``VARIANTS``), timed interleaved over 5 rounds: ms per decode step and the share of the card's
  bandwidth (the weights a step reads over the datasheet's bandwidth, as ``onegpu bench infer``);
  then a profiler trace of 16 decode steps of the first variant (``trace-b<batch>.json.gz`` in
  ``--out``), summarized: kernel time per step (the GPU busy), the host's time between graph
  launches, and the kernels that take the most.

The model is the 1b preset (hidden 2048, 16 layers, vocabulary 128,256), random init, bf16, as
``onegpu bench infer --preset gpu`` builds it; prompts of 512 random tokens, 128 new tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

# the CPU profiler's timing: each engine step ends in a read-back, which waits for the card
from profile_engine import decode_ms  # the script's own folder

PROMPT, NEW = 512, 128


def build_model():
    from transformers import LlamaForCausalLM

    from onegpu import models
    from onegpu.data.tokenizer import train_tokenizer

    tok = train_tokenizer([__doc__ * 20], vocab_size=512, fingerprint="profile-engine-gpu")
    torch.manual_seed(0)
    config = models.preset_config("1b", tok, vocab_size=128256)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model, tok


def graph_us(fn, calls: int = 20, replays: int = 20) -> float:
    """µs per call of ``fn`` replayed as one CUDA graph of ``calls`` calls (warmed up first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / (replays * calls))
    return statistics.median(times)


def attention_variants(batch: int, length: int, kv_len: int, heads=32, kv_heads=8, dim=64):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from onegpu.infer import gqa_attention

    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = (
        rnd(batch, heads, 1, dim),
        rnd(batch, kv_heads, kv_len, dim),
        rnd(batch, kv_heads, kv_len, dim),
    )
    lengths = torch.full((batch,), length, device="cuda")
    mask = (torch.arange(kv_len, device="cuda")[None] < lengths[:, None])[:, None, None, :]
    groups = heads // kv_heads

    def repeat_kv():
        kk = (
            k[:, :, None]
            .expand(batch, kv_heads, groups, kv_len, dim)
            .reshape(batch, heads, kv_len, dim)
        )
        vv = (
            v[:, :, None]
            .expand(batch, kv_heads, groups, kv_len, dim)
            .reshape(batch, heads, kv_len, dim)
        )
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

    def grouped():
        return gqa_attention.attention_forward(None, q, k, v, mask)[0].transpose(1, 2)

    def enable_gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    block_mask = create_block_mask(
        lambda b, h, qi, ki: ki < lengths[b], B=batch, H=None, Q_LEN=1, KV_LEN=kv_len, device="cuda"
    )
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_decode():
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    kk, vv = (
        k[:, :, :length].repeat_interleave(groups, 1),
        v[:, :, :length].repeat_interleave(groups, 1),
    )

    def flash_floor():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv)

    return {
        "repeat_kv + SDPA, bool mask (transformers)": repeat_kv,
        "grouped queries + SDPA, bool mask (the engine's)": grouped,
        "SDPA enable_gqa, bool mask": enable_gqa,
        "FlexAttention decoding, block mask (compiled)": flex_decode,
        "flash, valid keys only, no mask (floor)": flash_floor,
    }


def attention_table(batches) -> None:
    # the cache holds prompt + new tokens; a row is halfway through its new tokens
    kv_len, valid = PROMPT + NEW, PROMPT + NEW // 2
    print(f"\n## Decode attention alone (32 heads over 8, dim 64, KV {kv_len}, valid {valid})\n")
    print("| batch | attention | µs per call | x the first | max abs diff |\n|---|---|---|---|---|")
    for batch in batches:
        variants = attention_variants(batch, valid, kv_len)
        ref = None
        first = None
        for name, fn in variants.items():
            try:
                out = fn().float()
                us = graph_us(fn)
            except Exception as err:  # one kernel that does not run here must not hide the rest
                print(f"| {batch} | {name} | failed: {type(err).__name__}: {str(err)[:80]} | | |")
                continue
            ref = out if ref is None else ref
            first = us if first is None else first
            diff = (out - ref).abs().max().item()
            print(f"| {batch} | {name} | {us:.1f} | {us / first:.2f} | {diff:.3g} |")


def gemv_table(batches) -> None:
    """Each matmul shape of the 1b preset's layers: cuBLAS against small_gemv's reduction."""
    from onegpu.infer.small_gemv import SmallGemv

    F = torch.nn.functional
    shapes = [
        (512, 2048, "k, v"),
        (2048, 2048, "q, o"),
        (8192, 2048, "gate, up"),
        (2048, 8192, "down"),
    ]
    print("\n## One matmul of a decode step, bf16 (CUDA graphs of 20 calls)\n")
    print("| rows | weight | cuBLAS µs | reduction µs | ÷ cuBLAS | TB/s cuBLAS / reduction |")
    print("|---|---|---|---|---|---|")
    for m in batches:
        for n, k, what in shapes:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def lib(x=x, w=w):
                return F.linear(x, w)

            with torch._inductor.config.patch(
                post_grad_custom_pre_pass=SmallGemv(max_weight=n * k)
            ):
                red = torch.compile(lambda x=x, w=w: F.linear(x, w), dynamic=False)
                diff = (red().float() - lib().float()).abs().max().item()
            a, b = graph_us(lib), graph_us(red)
            tb = [2 * n * k / us / 1e6 for us in (a, b)]
            print(
                f"| {m} | {what} [{n}, {k}] | {a:.1f} | {b:.1f} | {b / a:.2f} | "
                f"{tb[0]:.2f} / {tb[1]:.2f} (diff {diff:.2g}) |"
            )


def argmax_table(batches) -> None:
    """The sampler's greedy argmax over the 1b preset's vocabulary, compiled: inductor's argmax
    against sampling.first_argmax (the maximum, then its first index)."""
    from onegpu.infer.sampling import first_argmax

    print("\n## Greedy argmax over 128,256 fp32 logits, compiled (CUDA graphs of 20 calls)\n")
    print("| rows | argmax µs | max + first index µs | equal |\n|---|---|---|---|")
    for m in batches:
        x = torch.randn(m, 128256, device="cuda")
        x[:, 7] = x[:, 9] = x.amax(-1) + 1  # a tie: the first index wins
        plain = torch.compile(lambda x=x: x.argmax(-1), dynamic=False)
        two = torch.compile(lambda x=x: first_argmax(x), dynamic=False)
        same = torch.equal(plain(), two())
        print(f"| {m} | {graph_us(plain):.1f} | {graph_us(two):.1f} | {same} |")


def engine_table(model, tok, batches, out: Path, bandwidth: float, variants) -> None:
    from onegpu.infer.engine import Engine, EngineConfig

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= model.get_input_embeddings().weight.numel() * 2  # a step reads one row of it
    print(f"\n## The engine, compiled (CUDA graphs), prompt {PROMPT}, {NEW} new tokens\n")
    print(f"weights read per step: {weights / 1e6:.0f} MB; bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("\n| batch | matmuls | ms per step, median (range) | % of bandwidth |\n|---|---|---|---|")
    for batch in batches:
        config = EngineConfig(max_slots=batch, max_len=PROMPT + NEW, compile="on", sync_every=8)
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(10, 128000, (batch, PROMPT), generator=gen).tolist()
        engines = {VARIANTS[v]: variant(Engine(model, tok, config), v) for v in variants}
        for e in engines.values():
            decode_ms(e, prompts, NEW)
        times = {n: [] for n in engines}
        for _ in range(5):
            for n, e in engines.items():
                times[n].append(decode_ms(e, prompts, NEW))
        for n, ms in times.items():
            med = statistics.median(ms)
            share = weights / (med / 1000) / bandwidth
            print(f"| {batch} | {n} | {med:.3f} ({min(ms):.3f}-{max(ms):.3f}) | {share:.1%} |")
        trace = out / f"trace-b{batch}.json"
        steps = profile(engines[SHIPPED], prompts, trace)
        summarize(str(trace) + ".gz", steps)


VARIANTS = {
    "reductions": "one-row matmuls of weights up to [2048, 2048] as reductions (the engine's)",
    "cublas": "cuBLAS for all",
    "autotune": "inductor's autotuned GEMMs (Triton or cuBLAS)",
    "repeat_kv": "cuBLAS for all, transformers' repeat_kv attention",
}
SHIPPED = VARIANTS["reductions"]


def variant(engine, name: str):
    """The engine with its compiled step as ``VARIANTS[name]`` says; a key of its own, so Dynamo
    does not hand it another engine's compiled step (inductor's settings are not guarded)."""
    from onegpu.infer import decode_step

    if name != "reductions":
        engine.decode_step.inductor.pop("post_grad_custom_pre_pass", None)
        engine.decode_step.key = next(decode_step._KEYS)
    if name == "repeat_kv":
        engine.decode_step.grouped = None
    if name == "autotune":
        engine.decode_step.inductor.update(
            max_autotune_gemm=True, max_autotune_gemm_backends="ATEN,TRITON"
        )
    return engine


def profile(engine, prompts, path: Path) -> int:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profiler

    from onegpu.infer.requests import SamplingParams

    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    engine.step()
    torch.cuda.synchronize()
    with run_profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
        dst.write(src.read())
    path.unlink()
    return 2 * engine.config.sync_every


def summarize(path: str, steps: int) -> None:
    """Kernel time per step, the host's time between graph launches, the top kernels."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    if not kernels:
        print(f"{path}: no kernel events")
        return
    busy = sum(e["dur"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    gaps = [b - a for a, b in zip(launches, launches[1:], strict=False)]
    print(
        f"\n### {Path(path).name}: {steps} decode steps, "
        f"{len(kernels) / steps:.0f} kernels a step\n"
    )
    print(f"- kernel time per step (GPU busy): {busy / steps / 1000:.3f} ms")
    print(f"- first kernel to last, per step: {span / steps / 1000:.3f} ms")
    if gaps:
        print(
            f"- host between graph launches: median {statistics.median(gaps) / 1000:.3f} ms "
            f"(min {min(gaps) / 1000:.3f}, {len(launches)} launches)"
        )
    by = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by[e["name"][:100]][0] += e["dur"]
        by[e["name"][:100]][1] += 1
    print("\n| kernel | calls a step | µs a step | share |\n|---|---|---|---|")
    for name, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"| `{name}` | {n / steps:.0f} | {us / steps:.1f} | {us / busy:.1%} |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile-engine-gpu")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--attention-only", action="store_true")
    parser.add_argument("--parts", default="attention,gemv,argmax,engine", help="what to run")
    parser.add_argument("--variants", default="reductions,cublas,autotune", help="engine's matmuls")
    parser.add_argument("--summarize", help="a trace-b<batch>.json.gz to summarize")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.steps)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch.split(",")]
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    torch._dynamo.config.recompile_limit = 64
    parts = args.parts.split(",")
    for part, table in (
        ("attention", attention_table),
        ("gemv", gemv_table),
        ("argmax", argmax_table),
    ):
        if part in parts:
            table(batches)
    if args.attention_only or "engine" not in parts:
        return 0
    from onegpu import hardware

    gbs, source = hardware.memory_bandwidth(hardware.detect())
    print(
        f"\nbandwidth {gbs:.0f} GB/s ({source}); "
        f"measured read {hardware.measure_read_gbs('cuda'):.0f} GB/s"
    )
    model, tok = build_model()
    engine_table(model, tok, batches, out, gbs * 1e9, args.variants.split(","))
    print(f"\nload {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
