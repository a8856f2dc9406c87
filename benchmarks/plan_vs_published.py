"""The planner's peak memory against a published table: torchtune's README "Optimization flags"
table, Llama-3.2-3B on one A100 80GB, batch 2, packed to 4096 tokens, bf16 weights, AdamW
(recipe full_finetune_single_device; LoRA rows lora_finetune_single_device, rank 64 on q, v, output
and the MLP). Each technique is added on top of the row before it, except LoRA and QLoRA, which
drop the step in backward and the 8-bit optimizer. Their "Peak Memory Active (GiB)" is
torch.cuda.memory_stats()["active_bytes.all.peak"] / 2**30, i.e. GiB of allocated tensors, which is
what the planner's peak predicts (without fragmentation or the CUDA context).

No download: the model is built from its config on the meta device; activations are measured on
CPU as the planner always does (several minutes the first time, cached afterwards).

    python benchmarks/plan_vs_published.py [--rows packed,compile] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
SEQ_LEN = 4096
LORA_TARGETS = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # torchtune: q, v, output_proj + MLP


@dataclass
class Row:
    key: str
    technique: str
    published_gib: float
    setup: dict | None  # Candidate fields; None: onegpu cannot express this row
    note: str = ""


def rows(chunk: int) -> list[Row]:
    """torchtune's rows as onegpu setups. Full fine-tune rows: bf16 weights (bf16-pure), torch AdamW
    (onegpu's adamw: fused on a GPU, no whole-model temporaries, which their 24.9 GiB row implies)."""
    base = dict(micro_batch=2, grad_accum=1, precision="bf16-pure", optimizer="adamw")
    packed = dict(base)
    comp = dict(packed, compile="default")
    chunked = dict(comp, loss_chunk=chunk)
    ckpt = dict(chunked, checkpointing="full")
    in_bwd = dict(ckpt, in_backward=True)
    offload = dict(in_bwd, checkpointing="offload")
    eight = dict(offload, optimizer="adamw-8bit")
    lora = dict(offload, in_backward=False, lora_rank=64, lora_targets=LORA_TARGETS)  # lora.dtype auto: bf16
    qlora = dict(lora, quantize_base="nf4")
    return [
        Row("baseline", "Baseline (unpacked)", 25.5, None,
            "rows padded to the longest alpaca-cleaned example of each batch: the peak depends on the "
            "dataset's length distribution, which the planner does not model (it plans full rows)"),
        Row("packed", "+ Packed Dataset", 60.0, packed),
        Row("compile", "+ Compile", 51.0, comp, "compile's memory: elementwise intermediates recomputed (modelled)"),
        Row("chunked", "+ Chunked Cross Entropy", 42.9, chunked,
            "onegpu's fused loss (gradients in the forward) stands in for torchtune's chunked CE, "
            "which keeps the whole bf16 logits"),
        Row("ckpt", "+ Activation Checkpointing", 24.9, ckpt),
        Row("in_bwd", "+ Fuse optimizer step into backward", 23.1, in_bwd),
        Row("offload", "+ Activation Offloading", 21.8, offload),
        Row("adamw8bit", "+ 8-bit AdamW", 17.6, eight, "bitsandbytes AdamW8bit"),
        Row("lora", "LoRA", 8.5, lora, "rank 64, bf16 adapters (torchtune trains them in bf16)"),
        Row("qlora", "QLoRA", 4.6, qlora, "bitsandbytes nf4 stands in for torchao's NF4"),
    ]


def predict(selected: list[str] | None = None) -> dict:
    from transformers import LlamaConfig

    from onegpu.config import TechniquesConfig
    from onegpu.plan import memory
    from onegpu.plan.arch import _shape_of
    from onegpu.plan.candidate import Candidate
    from onegpu.plan.published import LLAMA_3_2_3B
    from onegpu.techniques.fused_loss import fused_chunk

    shape = _shape_of("Llama-3.2-3B", LlamaConfig(**LLAMA_3_2_3B))
    chunk = fused_chunk(TechniquesConfig(), shape.vocab, on_gpu=True, sharded=False)
    out = []
    for row in rows(chunk):
        if selected and row.key not in selected:
            continue
        entry = {"key": row.key, "technique": row.technique, "published_gib": row.published_gib, "note": row.note}
        if row.setup is not None:
            c = Candidate(**row.setup)
            est = memory.estimate(shape, c, SEQ_LEN, on_gpu=True, attention="sdpa")
            entry.update(setup=c.label(), predicted_gib=round(est.peak / GIB, 2),
                         ratio=round(est.peak / GIB / row.published_gib, 3),
                         components_gib={k: round(v / GIB, 2) for k, v in est.components.items()})
        out.append(entry)
    return {"model": "Llama-3.2-3B", "params": shape.params, "gpu": "A100 80GB", "seq_len": SEQ_LEN,
            "micro_batch": 2, "rows": out}


def markdown(result: dict) -> str:
    lines = [f"Llama-3.2-3B on one A100 80GB, batch 2 x {SEQ_LEN} tokens (packed), bf16 weights. Published: "
             "torchtune README (Peak Memory Active, GiB). Predicted: onegpu's planner, peak allocated GiB.", "",
             "| technique (cumulative) | published GiB | predicted GiB | predicted/published | onegpu setup / what is missing |",
             "|:--|--:|--:|--:|:--|"]
    for r in result["rows"]:
        if "predicted_gib" in r:
            what = f"`{r['setup']}`" + (f"; {r['note']}" if r["note"] else "")
            lines.append(f"| {r['technique']} | {r['published_gib']:.1f} | {r['predicted_gib']:.1f} | "
                         f"{r['ratio']:.2f} | {what} |")
        else:
            lines.append(f"| {r['technique']} | {r['published_gib']:.1f} | - | - | not expressible: {r['note']} |")
    meta = result["meta"]
    lines += ["", f"{meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
                  f"command: `{meta['command']}`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="comma-separated row keys (default: all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    import torch
    import transformers

    result = predict([k for k in args.rows.split(",") if k] or None)
    result["meta"] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                      "transformers": transformers.__version__,
                      "command": "python benchmarks/plan_vs_published.py" + (f" --rows {args.rows}" if args.rows else ""),
                      "source": "https://github.com/pytorch/torchtune/blob/main/README.md (Optimization flags)"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_published.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "plan_vs_published.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
