"""torchtune's published peaks as onegpu setups, and the planner's predictions for them: the rows
of results/plan_vs_published.md (written once by benchmarks/plan_vs_published.py, the script at
d9acb51), kept for the tests that hold the planner to them (test_plan_published.py,
test_plan_context.py).

torchtune's README "Optimization flags" table: Llama-3.2-3B on one A100 80GB, batch 2, packed to
4096 tokens, bf16 weights, AdamW (recipe full_finetune_single_device; LoRA rows
lora_finetune_single_device, rank 64 on q, v, output and the MLP). Each technique is added on top of
the row before it, except LoRA and QLoRA, which drop the step in backward and the 8-bit optimizer.
Their "Peak Memory Active (GiB)" is torch.cuda.memory_stats()["active_bytes.all.peak"] / 2**30,
i.e. GiB of allocated tensors, which is what the planner's peak predicts (without fragmentation or
the CUDA context). Then torchtune's Llama-3.1-8B full fine-tune on one RTX 4090 (18.9 GiB): does the
search find it, and at what predicted peak. No download: the models are built from their configs.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
SEQ_LEN = 4096
MICRO_BATCH = 2
LORA_TARGETS = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # torchtune: q, v, output + MLP


@dataclass
class Row:
    key: str
    technique: str
    published_gib: float
    setup: dict | None  # TechniquesConfig overrides (candidate.setup); None: not expressible
    note: str = ""


def rows(chunk: int) -> list[Row]:
    """torchtune's rows as onegpu setups. Full fine-tune rows: bf16 weights (bf16-pure), torch AdamW
    (onegpu's adamw: fused on a GPU, no whole-model temporaries, which their 24.9 GiB row implies).
    """
    base = {"precision": "bf16-pure", "optimizer": "adamw"}
    packed = dict(base)
    comp = dict(packed, compile="default")
    chunked = dict(comp, loss_chunk_size=chunk)
    ckpt = dict(chunked, checkpointing="full")
    in_bwd = dict(ckpt, optimizer_in_backward=True)
    offload = dict(in_bwd, activation_offload=True)  # torchtune offloads the checkpointed inputs
    eight = dict(offload, optimizer="adamw-8bit")
    # the LoRA rows: the adapters' dtype left to auto (bf16)
    lora = dict(offload, optimizer_in_backward=False, lora={"r": 64, "targets": LORA_TARGETS})
    qlora = dict(lora, lora={"r": 64, "targets": LORA_TARGETS, "quantize_base": "nf4"})
    return [
        Row("baseline", "Baseline (unpacked)", 25.5, None,
            "rows padded to the longest alpaca-cleaned example of each batch: the peak depends on "
            "the dataset's length distribution, which the planner does not model (it plans full "
            "rows)"),
        Row("packed", "+ Packed Dataset", 60.0, packed),
        Row("compile", "+ Compile", 51.0, comp,
            "compile's memory: elementwise intermediates recomputed (modelled)"),
        Row("chunked", "+ Chunked Cross Entropy", 42.9, chunked,
            "onegpu's fused loss (gradients in the forward) stands in for torchtune's chunked CE, "
            "which keeps the whole bf16 logits"),
        Row("ckpt", "+ Activation Checkpointing", 24.9, ckpt),
        Row("in_bwd", "+ Fuse optimizer step into backward", 23.1, in_bwd),
        Row("offload", "+ Activation Offloading", 21.8, offload),
        Row("adamw8bit", "+ 8-bit AdamW", 17.6, eight, "bitsandbytes AdamW8bit"),
        Row("lora", "LoRA", 8.5, lora, "rank 64, bf16 adapters (torchtune trains them in bf16)"),
        Row("qlora", "QLoRA", 4.6, qlora, "bitsandbytes nf4 stands in for torchao's NF4"),
    ]  # fmt: skip


def predict(selected: list[str] | None = None) -> dict:
    from transformers import LlamaConfig

    from onegpu.config import TechniquesConfig
    from onegpu.plan import memory
    from onegpu.plan.arch import _shape_of
    from onegpu.plan.candidate import setup
    from onegpu.plan.published import LLAMA_3_2_3B
    from onegpu.techniques.fused_loss import fused_chunk

    shape = _shape_of("Llama-3.2-3B", LlamaConfig(**LLAMA_3_2_3B))
    chunk = fused_chunk(TechniquesConfig(), shape.vocab, on_gpu=True, sharded=False)
    out = []
    for row in rows(chunk):
        if selected and row.key not in selected:
            continue
        entry = {
            "key": row.key,
            "technique": row.technique,
            "published_gib": row.published_gib,
            "note": row.note,
        }
        if row.setup is not None:
            c = setup(MICRO_BATCH, 1, **row.setup)
            est = memory.estimate(shape, c, SEQ_LEN, on_gpu=True, attention="sdpa")
            entry.update(
                setup=c.label(),
                predicted_gib=round(est.peak / GIB, 2),
                ratio=round(est.peak / GIB / row.published_gib, 3),
                components_gib={k: round(v / GIB, 2) for k, v in est.components.items()},
            )
        out.append(entry)
    return {
        "model": "Llama-3.2-3B",
        "params": shape.params,
        "gpu": "A100 80GB",
        "seq_len": SEQ_LEN,
        "micro_batch": MICRO_BATCH,
        "rows": out,
    }


# torchtune README, single-device table: Llama-3.1-8B full fine-tune on one RTX 4090, batch 2 x
# 2048: bf16 weights, paged 8-bit AdamW with the step in backward, activation checkpointing, chunked
# CE.
LLAMA_8B_4090 = {
    "published_gib": 18.9,
    "published_tokens_per_s": 1650.0,
    "seq_len": 2048,
    "batch": 2,
}


def torchtune_setup(techniques) -> bool:
    """Whether a candidate's techniques are torchtune's 8B/4090 setup (the fused loss standing in
    for its chunked cross-entropy; compile either way)."""
    return (
        techniques.precision == "bf16-pure"
        and techniques.optimizer == "paged-adamw-8bit"
        and techniques.optimizer_in_backward
        and techniques.checkpointing == "full"
        and techniques.loss != "plain"
        and not techniques.activation_offload
        and techniques.tiled_mlp == "off"
    )


def predict_8b_4090() -> dict:
    """Search Llama-3.1-8B full fine-tuning on an RTX 4090 as `onegpu plan` does; report whether
    torchtune's setup is among the rows that fit, its predicted peak and speed, and the plan's pick.
    """
    from transformers import LlamaConfig

    from onegpu.config import Config
    from onegpu.hardware import find_gpu
    from onegpu.plan.arch import _shape_of
    from onegpu.plan.published import LLAMA_3_1_8B
    from onegpu.plan.search import search

    shape = _shape_of("Llama-3.1-8B", LlamaConfig(**LLAMA_3_1_8B))
    ref = LLAMA_8B_4090
    plan = search(Config(), find_gpu("RTX4090"), shape, ref["seq_len"], ref["batch"])
    theirs = [r for r in plan.rows if r.fits and torchtune_setup(r.candidate.techniques)]
    out = dict(ref, found=bool(theirs), best=plan.best.candidate.label() if plan.best else None)
    if theirs:
        row = min(theirs, key=lambda r: r.candidate.techniques.compile != "off")  # eager first
        out.update(
            setup=row.candidate.label(),
            predicted_gib=round(row.memory.peak / GIB, 2),
            ratio=round(row.memory.peak / GIB / ref["published_gib"], 3),
            predicted_tokens_per_s=round(row.speed.tokens_per_s),
            components_gib={k: round(v / GIB, 2) for k, v in row.memory.components.items()},
        )
    return out
