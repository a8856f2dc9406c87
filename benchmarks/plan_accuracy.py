"""Planner accuracy on this GPU: predicted peak memory and tokens/s against
torch.cuda.max_memory_allocated and measured throughput, for several models and setups.

    python benchmarks/plan_accuracy.py [--seq_len 1024] [--calibrate]

Writes benchmarks/results/plan_accuracy-<gpu>.json (with device, versions, command, date) and prints
a markdown table. --calibrate stores the measured efficiency for later `onegpu plan` runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def models():
    from transformers import LlamaConfig, MixtralConfig

    from onegpu.plan.arch import load_config

    return {
        "small": load_config("small", 32000),
        "125m": load_config("125m", 32000),
        "1b": load_config("1b", 32000),
        "mixtral-tiny": MixtralConfig(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
        ),
        "llama-gqa": LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
    }


def setups():
    from onegpu.plan.candidate import setup as C

    return [
        C(8, 1, precision="bf16"),
        C(8, 1, precision="bf16", checkpointing="full"),
        C(8, 1, precision="bf16", checkpointing="every-n"),
        C(16, 1, precision="bf16", checkpointing="full"),
        C(8, 1, precision="bf16-pure"),
        C(8, 2, precision="bf16", optimizer="adamw-8bit"),
        C(8, 1, precision="bf16", checkpointing="full", loss_chunk_size=4096),
        C(8, 1, precision="bf16", checkpointing="full", lora={"r": 16}),
    ]


def main(argv=None) -> int:
    import torch
    import transformers

    from onegpu import hardware
    from onegpu.plan import accuracy, memory, speed
    from onegpu.plan.arch import _shape_of

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--models", default="", help="comma-separated subset")
    from onegpu.cli.args import renamed

    args = ap.parse_args(
        renamed(sys.argv[1:] if argv is None else argv, {"--seq-len": "--seq_len"})
    )
    spec = hardware.spec_from_device(hardware.detect())
    rows = []
    for name, config in models().items():
        if args.models and name not in args.models.split(","):
            continue
        shape = _shape_of(name, config)
        for c in setups():
            mem = memory.estimate(shape, c, args.seq_len)
            if not mem.fits(spec.memory_gib * 2**30):
                continue
            pred = speed.estimate(shape, c, args.seq_len, spec)
            try:
                got = accuracy.step_peak(config, c, args.seq_len)
            except torch.OutOfMemoryError:
                got = {"peak_bytes": float("nan"), "tokens_per_s": float("nan")}
                torch.cuda.empty_cache()
            rows.append(
                {
                    "model": name,
                    "setup": c.label(),
                    "pred_gb": mem.peak / 2**30,
                    "meas_gb": got["peak_bytes"] / 2**30,
                    "pred_tok_s": pred.tokens_per_s,
                    "meas_tok_s": got["tokens_per_s"],
                    "calibrated": pred.calibrated,
                    "efficiency": got["tokens_per_s"]
                    * pred.flops_per_token
                    / (spec.peak_tflops(c.techniques.precision) * 1e12),
                }
            )
            print(_row(rows[-1]), flush=True)
    if args.calibrate and rows:
        best = max(rows, key=lambda r: r["efficiency"] if r["efficiency"] == r["efficiency"] else 0)
        speed.save_calibration(spec.key, "bf16", best["efficiency"], 8 * args.seq_len)
    out = Path(__file__).parent / "results" / f"plan_accuracy-{spec.key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "gpu": spec.key,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "command": " ".join(sys.argv),
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "seq_len": args.seq_len,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out}")
    return 0


def _row(r: dict) -> str:
    err = (r["pred_gb"] / r["meas_gb"] - 1) * 100 if r["meas_gb"] == r["meas_gb"] else float("nan")
    return (
        f"| {r['model']} | {r['setup']} | {r['pred_gb']:.2f} | {r['meas_gb']:.2f} | {err:+.1f}% | "
        f"{r['pred_tok_s']:,.0f} | {r['meas_tok_s']:,.0f} |"
    )


if __name__ == "__main__":
    print(
        "| model | setup | predicted GB | measured GB | error | predicted tok/s | measured tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    sys.exit(main())
