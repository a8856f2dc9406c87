"""Where a decode step of onegpu's engine spends its time: torch.profiler over a few engine steps.

    python benchmarks/profile_engine.py                      # tiny preset, batch 1, compiled
    python benchmarks/profile_engine.py --batch 16 --compile off
    python benchmarks/profile_engine.py --head-ab   # the output head as stored vs transposed
    python benchmarks/profile_engine.py --argmax-ab --batch 16  # the step's argmax, two ways
    python benchmarks/profile_engine.py --argmax-ab --compile off --vocab 128256  # eagerly
    python benchmarks/profile_engine.py --attention-ab --batch 16  # SDPA vs inductor loops

The model is the `tiny` preset (vocab 32000, fp32, random init) as `onegpu bench infer --preset cpu`
builds it; prompts of 512 random tokens, 128 new tokens. The step time is measured without the
profiler (median of 5 batches); the profiler's shares (which it inflates evenly) split it into: the
compiled graph, Dynamo's guard evaluation ("TorchDynamo Cache Lookup"), attention
(``scaled_dot_product_attention``), matmuls, the read-back to the host, and the rest — Python and
bookkeeping between the ops.

``--head-ab`` instead times, interleaved over 5 rounds, the same compiled engine on the model as it
is (output head ``F.linear(x, W)``, W stored [vocab, hidden]) and on a copy whose head multiplies by
a contiguous [hidden, vocab] copy of W (``x @ W_t``): what the CPU's matmul does with each layout,
and whether the greedy tokens stay the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

# each profiler event counts in the first group it matches, in this order
GROUPS = {
    # inductor's C++ GEMMs (graph_N_gemm_*) where a step was compiled with them, MKL's linear
    "matmuls (inductor's GEMMs, aten::mm/addmm, mkl::_mkl_linear)": (
        "_gemm_",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "mkl::_mkl_linear",
    ),
    "attention (SDPA kernel, its mask's fused kernels)": ("scaled_dot_product",),
    "guard evaluation (TorchDynamo Cache Lookup)": ("TorchDynamo Cache Lookup",),
    "read-back (tolist: aten::_local_scalar_dense, cat)": ("_local_scalar_dense", "aten::cat"),
    "the compiled graph's other kernels and its wrapper": ("CompiledFxGraph", "cpp_fused"),
}


def group_of(key: str):
    return next((g for g, keys in GROUPS.items() if any(k in key for k in keys)), None)


def build(batch: int, new_tokens: int, prompt_len: int, compile_mode: str):

    from onegpu import models
    from onegpu.data.tokenizer import train_tokenizer
    from onegpu.infer.engine import Engine, EngineConfig

    tok = train_tokenizer([__doc__ * 20], vocab_size=512, fingerprint="profile-engine")
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(models.preset_config("tiny", tok, vocab_size=32000)).eval()
    config = EngineConfig(
        max_slots=batch, max_len=prompt_len + new_tokens, compile=compile_mode, sync_every=8
    )
    prompts = torch.randint(10, 32000, (batch, prompt_len), generator=torch.Generator()).tolist()
    return Engine(model, None, config), prompts


def decode_ms(engine, prompts, new_tokens: int) -> float:
    """ms per decode step over the engine steps after the first (which holds the prefills)."""
    from onegpu.infer.requests import SamplingParams

    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.step()
    done, t0 = 1 + engine.config.sync_every, time.perf_counter()
    while engine.has_work():
        engine.step()
    return 1000 * (time.perf_counter() - t0) / (new_tokens - done)


def profile_steps(engine, prompts, new_tokens: int, steps: int = 4):
    from torch.profiler import ProfilerActivity, profile

    from onegpu.infer.requests import SamplingParams

    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    decoded = min(steps * engine.config.sync_every, new_tokens - 1 - engine.config.sync_every)
    return prof.key_averages(), wall, decoded


class TransposedHead(torch.nn.Module):
    """An output head computing ``x @ W_t`` from a contiguous [hidden, vocab] copy of W."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight  # the engine reads the vocabulary size from it
        self.register_buffer("wt", weight.detach().t().contiguous())

    def forward(self, x):
        return x @ self.wt


def ab(engines: dict, prompts, args, what: str, column: str) -> None:
    """Engines timed interleaved over 5 rounds after a warm-up each (compiles), a table of their
    ms per decode step, and whether their greedy tokens all agree."""
    import os

    from onegpu.infer.requests import SamplingParams

    times = {name: [] for name in engines}
    for engine in engines.values():
        decode_ms(engine, prompts, args.new_tokens)  # warm-up: compiles
    for _ in range(5):
        for name, engine in engines.items():
            times[name].append(decode_ms(engine, prompts, args.new_tokens))
    print(
        f"{what}, tiny preset, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; 5 interleaved "
        "rounds"
    )
    print(f"\n| {column} | ms per decode step, median (range) |\n|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")
    params = SamplingParams(max_new_tokens=min(32, args.new_tokens), ignore_eos=True)
    tokens = [[r.token_ids for r in e.generate(prompts, params)] for e in engines.values()]
    print(f"\ngreedy tokens equal: {all(t == tokens[0] for t in tokens)}")


def head_ab(args) -> None:
    import copy

    from onegpu.infer.engine import Engine

    as_is, prompts = build(args.batch, args.new_tokens, args.prompt_len, args.compile)
    model = copy.deepcopy(as_is.model)
    model.lm_head = TransposedHead(model.lm_head.weight)
    engines = {"F.linear(x, W), W [vocab, hidden]": as_is}
    engines["x @ W_t, W_t contiguous [hidden, vocab]"] = Engine(model, None, as_is.config)
    ab(engines, prompts, args, f"engine, compile {args.compile}", "output head")


def argmax_ab(args) -> None:
    """The next-token argmax over [batch, vocab] fp32 logits two ways; µs per call, median of
    200 calls, 5 interleaved rounds. Compiled (inductor, --compile on): ``argmax(-1)`` against
    sampling.first_argmax as a compiled CPU step writes it (the maximum, then the first index
    holding it); eager (--compile off): ``argmax(-1)`` against ``max(-1).indices``, as
    first_argmax runs eagerly."""
    import os

    from onegpu.infer.sampling import first_argmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen)
    logits[:, 7] = logits[:, 11] = 100.0  # a tie: both ways give the first
    if args.compile == "on":
        ways = {
            "logits.argmax(-1)": torch.compile(lambda x: x.argmax(-1)),
            "maximum, then its first index (first_argmax)": torch.compile(first_argmax),
        }
    else:
        ways = {
            "logits.argmax(-1)": lambda x: x.argmax(-1),
            "logits.max(-1).indices (first_argmax)": first_argmax,
        }
    assert len({tuple(f(logits).tolist()) for f in ways.values()}) == 1  # the same tokens

    def us(f):
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            f(logits)
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    rounds = {name: [] for name in ways}
    for _ in range(5):
        for name, f in ways.items():
            rounds[name].append(us(f))
    how = "compiled" if args.compile == "on" else "eager"
    print(
        f"{how} argmax over [{args.batch}, {args.vocab}] fp32 logits, {torch.get_num_threads()} "
        f"threads, load {os.getloadavg()[0]:.2f}; 5 interleaved rounds of 200 calls\n"
    )
    print("| argmax | µs per call (the call's overhead included), median (range) |\n|---|---|")
    for name, t in rounds.items():
        print(f"| {name} | {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f}) |")


def attention_ab(args) -> None:
    """The compiled CPU step's decode attention two ways: SDPA's CPU kernel (transformers'
    function) and the softmax written out as inductor loops over the blocks (cpu_attention, the
    engine's)."""
    from onegpu.infer.engine import Engine

    engine, prompts = build(args.batch, args.new_tokens, args.prompt_len, "on")
    # (the engine takes the loops at every row count)
    sdpa = Engine(engine.model, None, engine.config)
    sdpa.decode_step.grouped = None  # transformers' SDPA function in the steps
    engines = {"SDPA's CPU kernel": sdpa, "inductor loops (the engine's)": engine}
    ab(engines, prompts, args, "engine compiled (inductor)", "decode attention")


def main(argv: list[str]) -> int:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile", choices=["on", "off"], default="on")
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000, help="--argmax-ab's logits' width")
    parser.add_argument("--prompt_len", type=int, default=512)
    parser.add_argument("--head-ab", action="store_true", help="time the head's two layouts")
    parser.add_argument("--argmax-ab", action="store_true", help="time the two argmaxes")
    parser.add_argument("--attention-ab", action="store_true", help="time SDPA vs the loops")
    args = parser.parse_args(argv)
    if args.head_ab:
        head_ab(args)
        return 0
    if args.argmax_ab:
        argmax_ab(args)
        return 0
    if args.attention_ab:
        attention_ab(args)
        return 0
    # the compiled step's kernels as profiler events of their own (its C++ wrapper calls them
    # out of the Python profiler's sight otherwise); they add a little to the timed steps too
    torch._inductor.config.cpp.enable_kernel_profile = True
    engine, prompts = build(args.batch, args.new_tokens, args.prompt_len, args.compile)
    decode_ms(engine, prompts, args.new_tokens)  # warm-up: compiles
    wall = [decode_ms(engine, prompts, args.new_tokens) for _ in range(5)]
    events, prof_wall, steps = profile_steps(engine, prompts, args.new_tokens)
    ms = statistics.median(wall)
    print(
        f"engine, tiny preset, batch {args.batch}, compile {args.compile}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}: {ms:.2f} ms per "
        f"decode step (median of 5; range {min(wall):.2f}-{max(wall):.2f})"
    )
    total_us, rest = 1e6 * prof_wall, 1.0
    print(f"\n| part | share of the profiled steps | ms per step at {ms:.2f} |\n|---|---|---|")
    for label in GROUPS:
        us = sum(e.self_cpu_time_total for e in events if group_of(e.key) == label)
        calls = sum(e.count for e in events if group_of(e.key) == label)
        share = us / total_us
        print(f"| {label} ({calls / steps:.0f} calls a step) | {share:.1%} | {share * ms:.2f} |")
        rest -= share
    print(f"| the rest: Python and bookkeeping between ops | {rest:.1%} | {rest * ms:.2f} |")
    print(f"\nprofiled: {steps} decode steps in {prof_wall * 1000:.1f} ms with the profiler on")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
