"""Published measurements behind the planner's assumptions, each with its source.

Until a probe has measured this GPU, the speed model rests on these: a compute-only efficiency per
GPU class, derived by our own FLOP count (arch.flops_per_token) and speed model from a public run,
and the speed factors of compile and of a 4-bit base. They stay labelled as assumptions in every
plan that uses them. ``tests/test_plan_published.py`` re-derives each efficiency from its run.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCHTUNE_README = (
    "https://github.com/pytorch/torchtune/blob/main/README.md (Optimization flags table, 2024-11)"
)
TORCHTITAN_H100 = (
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
)


@dataclass(frozen=True)
class PublishedRun:
    """One public training-speed measurement, with what we need to re-derive its efficiency."""

    source: str
    gpu: str  # hardware catalog key of the GPU the run used
    model: str  # the model: a name and the config values that set its FLOPs
    config: dict  # LlamaConfig arguments of that model
    setup: str
    micro_batch: int
    seq_len: int
    tokens_per_s: float  # per GPU
    # compute-only efficiency by our count (speed.compute_efficiency), re-derived in tests
    efficiency: float


LLAMA_3_2_3B = dict(
    vocab_size=128256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
LLAMA_3_1_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)

# Efficiency by compute capability (GPU class). Eager rows only: compile's gain is its own factor.
EFFICIENCY_RUNS = {
    # A100 (Ampere datacenter): torchtune's "+ Packed Dataset" row, before compile. 7,075 tokens/s
    # x 23.5 GFLOP/token = 0.53 of the A100's 312 TFLOP/s end to end; 0.60 compute-only (the
    # optimizer step and the micro-batch fill taken back out, as a probe would).
    (8, 0): PublishedRun(
        TORCHTUNE_README,
        "A100-80GB",
        "Llama-3.2-3B",
        LLAMA_3_2_3B,
        "full fine-tune, bf16 weights, AdamW, packed, no compile / checkpointing, 1 GPU",
        2,
        4096,
        7075.0,
        0.599,
    ),
    # H100 (Hopper): torchtitan's FSDP row without compile or float8, 8 GPUs, per-GPU rate. Its
    # selective activation checkpointing recomputes some ops we do not count, and the GPUs ran at a
    # 500 W power limit, so this is a low estimate: 0.34 end to end, 0.36 compute-only (with the
    # optimizer step of one GPU holding the whole model taken out).
    (9, 0): PublishedRun(
        TORCHTITAN_H100,
        "H100",
        "Llama-3.1-8B",
        LLAMA_3_1_8B,
        "pre-training, FSDP over 8 H100 (per GPU), bf16 compute, AdamW, selective "
        "activation checkpointing, no compile",
        2,
        8192,
        5762.0,
        0.360,
    ),
}
# Other GPU classes: no single-GPU measurement cited yet; a middle value between the two above
# (an assumption, shown as such) until a probe measures the GPU.
FALLBACK_EFFICIENCY = 0.40

# Speed factors of methods that change kernels, not FLOPs.
# torchtune README, same table: "+ Compile" 7,075 -> 8,998 tokens/s (+27.2%), Llama-3.2-3B full
# fine-tune on one A100, packed to 4096. (torchtitan's 8B FSDP row: 5,762 -> 6,667, +15.7%.)
COMPILE_SPEEDUP = 8998 / 7075
# torchtune README, same table: LoRA 8,210 vs QLoRA 8,035 tokens/s (x0.979), both with compile,
# chunked loss, activation checkpointing and offload (torchao's NF4 kernels; bitsandbytes' may
# differ).
QLORA_SLOWDOWN = 8035 / 8210
# Compile's memory: torchtune README, same table, "+ Compile" 60.0 -> 51.0 GiB peak (-14.9%).
# Modelled by mechanism in activations.py (elementwise intermediates recomputed); this is its check.
COMPILE_MEMORY_CHECK = (60.0, 51.0)


def efficiency_run(capability: tuple) -> PublishedRun | None:
    return EFFICIENCY_RUNS.get(tuple(capability[:2])) if capability else None


def default_efficiency(capability: tuple) -> tuple[float, str]:
    """(efficiency, how it was obtained) for a GPU class without a probe."""
    run = efficiency_run(capability)
    if run is None:
        return (
            FALLBACK_EFFICIENCY,
            f"efficiency {FALLBACK_EFFICIENCY:.2f} (assumed: no published run for this GPU class, "
            "no probe on this GPU yet)",
        )
    return run.efficiency, (
        f"efficiency {run.efficiency:.2f} (published: {run.model} on {run.gpu}, "
        f"{run.tokens_per_s:,.0f} tokens/s; no probe on this GPU yet)"
    )


UNSLOTH_LLAMA_3_3 = (
    "https://unsloth.ai/blog/llama3-3 (Llama 3.1 (8B) max. context length table, 2024-12)"
)


@dataclass(frozen=True)
class PublishedContext:
    """A published longest trainable context: model, method, card memory, tokens at batch 1."""

    source: str
    model: str
    config: dict  # LlamaConfig arguments of that model (what --max-context matches a shape against)
    method: str
    lora_rank: int
    quantize_base: str
    card_gb: int  # the card's memory class, GB
    tokens: int  # Unsloth's longest sequence
    baseline_tokens: int  # Hugging Face + FlashAttention-2's, same card


# Unsloth (+ Apple Cut Cross Entropy) against Hugging Face + FA2: QLoRA on all linear layers,
# rank 32, batch 1, sequences padded to the length; 80 GB is an A100.
UNSLOTH_CONTEXT = (
    PublishedContext(
        UNSLOTH_LLAMA_3_3,
        "Llama-3.1-8B",
        LLAMA_3_1_8B,
        "QLoRA r32 all-linear",
        32,
        "nf4",
        24,
        78_475,
        5_789,
    ),
    PublishedContext(
        UNSLOTH_LLAMA_3_3,
        "Llama-3.1-8B",
        LLAMA_3_1_8B,
        "QLoRA r32 all-linear",
        32,
        "nf4",
        80,
        342_733,
        28_454,
    ),
)


def published_context(shape_config, memory_gib: float, lora) -> PublishedContext | None:
    """The published figure for this model shape, method (a LoraConfig) and card class, if any."""
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    card = 24 if 20 <= memory_gib < 30 else 80 if 70 <= memory_gib < 90 else 0
    for p in UNSLOTH_CONTEXT:
        same = all(shape_config.to_dict().get(k) == p.config[k] for k in keys)
        if (
            same
            and p.card_gb == card
            and lora.enabled
            and lora.r == p.lora_rank
            and lora.quantize_base == p.quantize_base
            and lora.targets == "all-linear"
        ):
            return p
    return None
