"""Float8 weights from torchao's public configs, checked on this CPU before they become a setting:
a LoRA run's frozen base, and the decode engine's weights. What a CPU can tell: whether they run,
what they store, how far their numbers are from bf16's, and the CPU's own speed (not a card's).

    flock /work/.bench.lock python benchmarks/fp8_weights_cpu.py

On the `small` preset (random init, bf16): each Linear of the decoder in float8 with
``Float8WeightOnlyConfig`` (e4m3 weights, a scale per row; the matmul in bf16 after dequantizing)
against bf16 and torchao's int8 weight-only (``--quantization ao-int8``): weight bytes, the
logits' relative error, greedy-token agreement over 8 tokens, ms per decoded token (5 rounds,
interleaved; median); and a LoRA step on the float8 base: the loss and the adapters' gradients
against the bf16 base's. ``Float8DynamicActivationFloat8WeightConfig`` (float8 matmuls: the one
that could be faster) is tried too and its refusal recorded. Writes results/fp8-weights-cpu.md.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "fp8-weights-cpu"


def small_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from onegpu.models import PRESETS

    torch.manual_seed(0)
    config = LlamaConfig(**PRESETS["small"], vocab_size=4096, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def quantized(model, kind: str):
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    configs = {
        "fp8-weight-only": Float8WeightOnlyConfig,
        "fp8-dynamic": Float8DynamicActivationFloat8WeightConfig,
        "ao-int8": Int8WeightOnlyConfig,
    }
    out = copy.deepcopy(model)
    head = out.get_output_embeddings()
    quantize_(
        out,
        configs[kind](),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not head,
    )
    return out


def decode_ms(model, ids, new: int = 8) -> tuple[float, list[int]]:
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return (time.perf_counter() - start) * 1000 / new, out[0, ids.shape[1] :].tolist()


def lora_step(model) -> tuple[float, torch.Tensor]:
    """One LoRA forward and backward (PEFT, r=16, all-linear) on a fixed batch: loss, grads."""
    import peft

    torch.manual_seed(2)  # the same adapters (PEFT draws lora_A at random) for every base
    m = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=16, target_modules="all-linear")
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (2, 128), generator=g)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = torch.cat(
        [p.grad.float().flatten() for n, p in m.named_parameters() if p.grad is not None]
    )
    return float(loss), grads


def main() -> int:
    from onegpu.techniques.quantization import weight_bytes

    load = {"before": list(os.getloadavg())}
    base = small_model()
    ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
    models, refused = {"bf16": base}, {}
    for kind in ("fp8-weight-only", "ao-int8", "fp8-dynamic"):
        try:
            models[kind] = quantized(base, kind)
            models[kind](ids)
        except Exception as exc:  # noqa: BLE001 - the refusal itself is the finding
            models.pop(kind, None)
            refused[kind] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    with torch.no_grad():
        ref = base(ids).logits.float()
        err = {
            k: float((m(ids).logits.float() - ref).norm() / ref.norm()) for k, m in models.items()
        }
    times = {k: [] for k in models}
    tokens = {}
    for _ in range(5):  # interleaved rounds
        for k, m in models.items():
            ms, tokens[k] = decode_ms(m, ids)
            times[k].append(ms)
    agree = {
        k: sum(a == b for a, b in zip(t, tokens["bf16"], strict=True)) / len(t)
        for k, t in tokens.items()
    }
    loss_ref, grads_ref = lora_step(base)
    loss8, grads8 = lora_step(models["fp8-weight-only"])
    doc = {
        "weight_mib": {k: weight_bytes(m) / 2**20 for k, m in models.items()},
        "logits_rel_error": err,
        "greedy_agreement": agree,
        "ms_per_token": {k: statistics.median(v) for k, v in times.items()},
        "ms_per_token_range": {k: [min(v), max(v)] for k, v in times.items()},
        "refused": refused,
        "lora": {
            "loss_bf16_base": loss_ref,
            "loss_fp8_base": loss8,
            "adapter_grad_rel_diff": float((grads8 - grads_ref).norm() / grads_ref.norm()),
        },
        "load": {**load, "after": list(os.getloadavg())},
        "versions": {
            p: __import__(p).__version__ for p in ("torch", "torchao", "transformers", "peft")
        },
        "threads": torch.get_num_threads(),
    }
    OUT.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    OUT.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    rows = "\n".join(
        f"| {k} | {doc['weight_mib'][k]:.1f} | {doc['logits_rel_error'][k]:.4f} | "
        f"{doc['greedy_agreement'][k]:.2f} | {doc['ms_per_token'][k]:.0f} "
        f"({doc['ms_per_token_range'][k][0]:.0f}-{doc['ms_per_token_range'][k][1]:.0f}) | "
        f"{doc['ms_per_token'][k] / doc['ms_per_token']['bf16']:.2f}x |"
        for k in doc["weight_mib"]
    )
    lora, w, e = doc["lora"], doc["weight_mib"], doc["logits_rel_error"]
    t = {k: v / doc["ms_per_token"]["bf16"] for k, v in doc["ms_per_token"].items()}
    refused = "; ".join(f"{k}: {v}" for k, v in doc["refused"].items()) or "none"
    return f"""# torchao's float8 weights on this CPU: for a frozen LoRA base and for decoding

`python benchmarks/fp8_weights_cpu.py` (`small` preset, random init, bf16; each decoder Linear
quantized with torchao, the head kept; greedy decoding with transformers' `generate`, 8 new
tokens after a 64-token prompt, 5 interleaved rounds, median and range; {doc["threads"]} threads;
torch {doc["versions"]["torch"]}, torchao {doc["versions"]["torchao"]}, transformers
{doc["versions"]["transformers"]}, peft {doc["versions"]["peft"]}; load (uptime) before
{[round(x, 2) for x in doc["load"]["before"]]}, after {[round(x, 2) for x in doc["load"]["after"]]}:
a shared machine, so the times are rough).

| weights | MiB | logits' relative error | greedy tokens as bf16's | ms per token | vs bf16 |
|---|--:|--:|--:|--:|--:|
{rows}

Refused here: {refused}.

LoRA (PEFT, r=16, all linear layers, the same adapters) on the float8 weight-only base: loss
{lora["loss_fp8_base"]:.4f} against {lora["loss_bf16_base"]:.4f} on the bf16 base; the adapters'
gradients differ by {lora["adapter_grad_rel_diff"]:.3f} (relative norm). It trains.

## Not made a setting, and why

- Memory: float8 weight-only stores {w["fp8-weight-only"]:.1f} MiB where torchao's int8
  weight-only stores {w["ao-int8"]:.1f} MiB: nothing beyond what `--quantization ao-int8` (the
  decode engine) and `techniques.lora.quantize_base=int8` (LoRA's base) already give, and twice
  what nf4 gives a LoRA base.
- Numbers: its logits are {e["fp8-weight-only"] / e["ao-int8"]:.1f}x further from bf16's than int8's
  ({e["fp8-weight-only"]:.4f} against {e["ao-int8"]:.4f}): e4m3 keeps 3 mantissa bits where a
  per-row int8 scale keeps about 7.
- Speed: it dequantizes the weight before each bf16 matmul, so a frozen base in float8 does more
  work than in bf16, not less; here it decodes at {t["fp8-weight-only"]:.2f}x bf16's time per
  token (int8: {t["ao-int8"]:.2f}x). A card's kernel may do better on a bandwidth-bound decode
  step, but that cannot be measured here.
- The one config that multiplies in float8 (and so could make a frozen base faster) refuses every
  device below an Ada or Hopper card (above); PEFT's torchao LoRA layer accepts int8 weights only
  (peft/tuners/lora/torchao.py: "only supports int8 weights for now"), so merging adapters into
  such a base would fail.

What FP8 gives LoRA instead is `techniques.fp8` with `techniques.lora.enabled`: the frozen base's
matmuls in float8 (torchao's training layers), the adapters in high precision; tested in
tests/test_fp8.py and modelled by the planner. The float8-matmul weight setting for the decode
engine waits for a card to measure it on.
"""


if __name__ == "__main__":
    sys.exit(main())
