"""Popular causal-LM families as tiny models: the architecture tests train each, the engine tests
decode with each."""

from __future__ import annotations

# Config class and the keys a tiny model of the family needs beyond COMMON (transformers 5.23).
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16}),
    "phi": ("PhiConfig", {}),
    "phi3": ("Phi3Config", {}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "granite": ("GraniteConfig", {}),
    "falcon": ("FalconConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "smollm3": ("SmolLM3Config", {}),
    "glm4": ("Glm4Config", {"head_dim": 16}),
    "cohere": (
        "CohereConfig",
        {"logit_scale": 0.5},
    ),  # Command-R's 0.0625 learns too slowly for 8 steps
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            # as many K/V heads as heads, as its real configs: with fewer, its attention repeats
            # the latent K/V for any explicit mask (transformers' own batched generate included)
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}


def tiny_family_model(family: str, tokenizer, **common_overrides):
    """A random tiny model of ``family`` (seeded), vocabulary and special tokens from ``tokenizer``.
    initializer_range 0.1, not the usual 0.02: the frozen random head of a LoRA run can then move
    its logits enough for the loss to fall clearly in a few steps."""
    import torch
    import transformers

    name, extra = FAMILIES[family]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update(common_overrides)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, name)(**{**common, **extra})
    )
