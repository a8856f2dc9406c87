"""A decode step's attention over the paged KV pool, three ways, at the kernel level, and over a
contiguous cache (the slot engine's layout, the reference paging gives up): the engine's
gather of each row's blocks into a view and SDPA over it (eager); the same gather inside a compiled
function feeding cpu_attention's softmax written out (on a CPU inductor reads the blocks where they
lie in its loops; on a GPU its reductions); torch's FlexAttention over the pool with a block mask
built from the block tables (compiled). Interleaved rounds, median and range, and the largest
difference from the eager reference.

    python benchmarks/paged_attention_ab.py [--device cuda] [--dtype bf16]

Shapes: the tiny and 125m presets' heads (4 x 32, 12 x 64) and the 1b preset's (32 over 8 key
heads x 64) on a GPU; 1 and 16 rows; 640 positions a row in blocks of 16, scattered over a pool
of every row's blocks. Writes benchmarks/results/paged-attention-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from onegpu.bench import provenance  # noqa: E402
from onegpu.infer.cpu_attention import decode as loops_decode  # noqa: E402
from onegpu.infer.paged_cache import PagedCache  # noqa: E402

B, LENGTH = 16, 640
SHAPES = {"tiny": (4, 4, 32), "125m": (12, 12, 64), "1b": (32, 8, 64)}  # heads, kv heads, dim


def case(heads, kv_heads, dim, rows, device, dtype):
    blocks = rows * LENGTH // B + 1
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randn(kv_heads, blocks * B, dim, generator=gen).to(device, dtype) for _ in "kv"]
    tables = (torch.randperm(blocks - 1, generator=gen)[: rows * LENGTH // B] + 1).view(rows, -1)
    q = torch.randn(rows, heads, 1, dim, generator=gen).to(device, dtype)
    return q, pool, tables.to(device), blocks


def gather(pool, tables, blocks):
    """The engine's gather (PagedCache.gather): each row's blocks as [rows, heads, L, dim]."""
    return PagedCache(blocks, B, pool.dtype, pool.device).gather(pool, tables)


def eager_sdpa(q, pool, tables, blocks):
    k, v = (gather(p, tables, blocks) for p in pool)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def fused_loops(q, pool, tables, blocks):
    k, v = (gather(p, tables, blocks) for p in pool)
    return loops_decode(q, k, v, None, q.shape[-1] ** -0.5).transpose(1, 2)


def block_mask(tables, blocks, device):
    """Every block but each row's last is full; the last holds the row's final positions (here all
    of them: rows of whole blocks). FlexAttention's lowering wants the tables as wide as the
    pool: a [rows, pool blocks] table a step."""
    rows, used = tables.shape
    wide = torch.zeros(rows, blocks, dtype=torch.int32, device=device)
    wide[:, :used] = tables
    ones = torch.ones(rows, 1, 1, dtype=torch.int32, device=device)
    last = tables[:, -1:].to(torch.int32).view(rows, 1, 1, 1).expand(rows, 1, 1, blocks)
    return BlockMask.from_kv_blocks(
        ones,
        last.contiguous(),
        ones * (used - 1),
        wide.view(rows, 1, 1, blocks),
        BLOCK_SIZE=(1, B),
        seq_lengths=(1, blocks * B),
    )


LOOPS = torch.compile(fused_loops, dynamic=False)
FLEX = torch.compile(flex_attention, dynamic=False)


def make_arms(inputs, device) -> dict:
    q, pool, tables, blocks = inputs
    mask = block_mask(tables, blocks, device)
    wide = [p[None] for p in pool]
    # the slot cache's layout: each row's positions already side by side (what paging gives up)
    flat = [gather(p, tables, blocks).contiguous() for p in pool]
    return {
        "contiguous cache + SDPA (no gather)": lambda: (
            torch.nn.functional.scaled_dot_product_attention(q, flat[0], flat[1], enable_gqa=True)
        ),
        "gather + SDPA (eager)": lambda: eager_sdpa(q, pool, tables, blocks),
        "gather + softmax loops (compiled)": lambda: LOOPS(q, pool, tables, blocks),
        "FlexAttention paged (compiled)": lambda: FLEX(
            q, wide[0], wide[1], block_mask=mask, enable_gqa=True
        ),
        "FlexAttention block mask (a step's)": lambda: block_mask(tables, blocks, device),
    }


def timed(fn, device, reps=20) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1000 * (time.perf_counter() - start) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    head, results = provenance.begin(), {}
    shapes = ["tiny", "125m"] if args.device == "cpu" else ["125m", "1b"]
    for name in shapes:
        for rows in (1, 8, 16) if args.device == "cuda" else (1, 16):
            arms = make_arms(case(*SHAPES[name], rows, args.device, dtype), args.device)
            ref = arms["gather + SDPA (eager)"]().float()
            diff = {
                k: (f().float() - ref).abs().max().item()
                for k, f in arms.items()
                if "mask" not in k
            }
            runs = {k: [] for k in arms}
            for _ in range(args.rounds):
                for k, f in arms.items():
                    runs[k].append(timed(f, args.device))
            key = f"{name}, {rows} rows"
            results[key] = {
                k: {"median_ms": statistics.median(v), "min": min(v), "max": max(v)}
                | ({"max_diff": diff[k]} if k in diff else {})
                for k, v in runs.items()
            }
            print(key, {k: round(v["median_ms"], 3) for k, v in results[key].items()}, flush=True)
    out = ROOT / (args.out or f"benchmarks/results/paged-attention-{args.device}")
    result = {
        **provenance.end(head),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "threads": args.threads,
        "results": results,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# A decode step's attention over the paged pool ({result['device']}, {args.dtype})",
        "",
        provenance.markdown(result),
        f"{args.threads} thread(s). {LENGTH} positions a row in blocks of {B}; "
        f"{args.rounds} interleaved rounds of 20 calls; "
        "ms a call (one layer), median (min-max); the largest difference from the eager "
        "reference.",
        "",
    ]
    for key, arms in results.items():
        lines += [f"## {key}", "", "| way | ms a call | max diff |", "|---|---|---|"]
        for k, v in arms.items():
            d = f"{v['max_diff']:.2e}" if "max_diff" in v else "-"
            lines.append(f"| {k} | {v['median_ms']:.3f} ({v['min']:.3f}-{v['max']:.3f}) | {d} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
