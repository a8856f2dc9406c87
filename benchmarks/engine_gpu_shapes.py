"""The paged engine's compiled decode on a card, at the 1b preset's shape and an 8B (Llama-3.1-8B)
shape, random weights built on the card in bf16 (no disk, no fp32 copy): ms per step and tokens/s
at batch 1 and 8, the share of the card's bandwidth (weights and the KV each row reads, as
`onegpu bench infer` counts them), each CUDA policy row on and off, and torchao's int8
weight-only decode against bf16 at batch 1. One process, the variants interleaved.

    python benchmarks/engine_gpu_shapes.py --out $OUT      # scripts/gpu_check.sh engine-shapes

Targets it answers (issue 41): the 1b preset at batch 1 at >= 1,000 tokens/s on an H100
(>= 1,250 on an H200); the 8B shape's bf16 decode at batch 1 at >= 70% of the bandwidth limit
and its int8 weight-only decode >= 1.4x bf16's; each policy row's gain on both shapes.
`--device cpu --shapes tiny` runs the same code on a CPU (a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=384, layers=4, heads=4, kv=4, vocab=32000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, layers=16, heads=32, kv=8, vocab=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, layers=32, heads=32, kv=8, vocab=128256),
}
PROMPT, NEW = 512, 128


def build(shape: str, device: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        max_position_embeddings=4096,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def int8(model):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


def run(engine, batch: int) -> float:
    """ms per decode step once every first token is out."""
    from onegpu.infer.requests import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(PROMPT)] for _ in range(batch)]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    ids = [engine.submit(p, params) for p in prompts]
    got = {i: 0 for i in ids}
    start = None
    while engine.has_work():
        for u in engine.step():
            got[u.request_id] += len(u.token_ids)
        if start is None and all(got.values()):
            _sync()
            start, out_by = time.perf_counter(), min(got.values())
    _sync()
    return 1000 * (time.perf_counter() - start) / (NEW - out_by)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from onegpu import hardware
    from onegpu.bench import infer_roofline as roof
    from onegpu.bench import provenance
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.paged_cache import kv_bytes_per_position

    head = provenance.begin()
    dtype = torch.bfloat16
    gbs, source = hardware.memory_bandwidth(hardware.detect())
    results = {}
    for shape in args.shapes.split(","):
        model = build(shape, args.device, dtype)
        per_pos, weights = kv_bytes_per_position(model), roof.weight_read_bytes(model)
        variants = {}
        for batch in (1, 8):
            config = dict(max_slots=batch, max_len=PROMPT + NEW, compile="on")
            variants[f"bf16, batch {batch}"] = (Engine(model, None, EngineConfig(**config)), batch)
            off = EngineConfig(**config, policy_off=["small_gemv"])
            variants[f"bf16, batch {batch}, small_gemv off"] = (Engine(model, None, off), batch)
        for name, (engine, batch) in variants.items():
            run(engine, batch)  # warm-up: compiles and captures
            print(f"{shape} {name}: warm", flush=True)
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (engine, batch) in variants.items():
                times[name].append(run(engine, batch))
        rows = {}
        for name, ms in times.items():
            batch = variants[name][1]
            median = statistics.median(ms)
            step = roof.bytes_per_step(weights, batch, PROMPT + NEW / 2, per_pos)
            rows[name] = {
                "ms_per_step": median,
                "range": [min(ms), max(ms)],
                "tokens_per_s": batch * 1000 / median,
                "bandwidth_share": roof.bandwidth_share(step, median, gbs),
            }
        if shape != "tiny" or args.device == "cuda":
            del variants
            q = Engine(int8(model), None, EngineConfig(max_slots=1, max_len=PROMPT + NEW))
            run(q, 1)
            ms = statistics.median(run(q, 1) for _ in range(args.rounds))
            rows["torchao int8 weight-only, batch 1"] = {
                "ms_per_step": ms,
                "tokens_per_s": 1000 / ms,
                "vs bf16": rows["bf16, batch 1"]["ms_per_step"] / ms,
            }
        results[shape] = rows
        print(json.dumps({shape: rows}, indent=1), flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = Path(args.out) / "engine-gpu-shapes.json"
    out.write_text(
        json.dumps(
            {
                **provenance.end(head),
                "device": device,
                "bandwidth_gbs": gbs,
                "bandwidth_source": source,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
