"""FLOPs per token: the one count (plan/arch.py) behind the planner's speed and the benchmarks'
MFU, checked against parameter counts written out by hand from each architecture's layers."""

from __future__ import annotations

import pytest

from onegpu.plan.arch import _shape_of, flops_per_token

H, I, L, V, HEADS, KV, SEQ = 64, 160, 3, 500, 4, 2, 256  # noqa: E741 (I: the FFN width, as in the formulae)
ATTN = 12 * L * H * SEQ  # QK^T and AV: forward 4*L*h*s, training 3x that


def _llama_blocks() -> int:
    d = H // HEADS
    attn = 2 * H * H + 2 * H * KV * d  # q, o; k, v (grouped-query)
    return (
        L * (attn + 3 * H * I + 2 * H) + H
    )  # + gate/up/down, two RMSNorms a layer, the final norm


@pytest.mark.parametrize("tied", [True, False])
def test_llama_counts_the_head_once_tied_or_not(tied):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        tie_word_embeddings=tied,
    )
    shape = _shape_of("llama", cfg)
    n = (
        _llama_blocks() + V * H
    )  # the head multiplies every token whether or not it shares the table
    assert shape.active_params == n
    assert flops_per_token(shape, SEQ) == 6 * n + ATTN


def test_gpt2_leaves_out_both_lookup_tables():
    from transformers import GPT2Config

    positions = 128
    cfg = GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=HEADS, n_positions=positions)
    shape = _shape_of("gpt2", cfg)
    block = (H * 3 * H + 3 * H) + (H * H + H) + (H * 4 * H + 4 * H) + (4 * H * H + H) + 2 * (2 * H)
    n = (
        L * block + 2 * H + V * H
    )  # + final LayerNorm, + the tied head; the position table is a lookup
    assert shape.params == n + positions * H
    assert shape.active_params == n
    assert flops_per_token(shape, SEQ) == 6 * n + ATTN


def test_moe_counts_only_the_experts_a_token_visits():
    from transformers import MixtralConfig

    experts, top_k = 4, 2
    cfg = MixtralConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        tie_word_embeddings=False,
    )
    shape = _shape_of("mixtral", cfg)
    d = H // HEADS
    attn = 2 * H * H + 2 * H * KV * d
    active_block = (
        attn + top_k * 3 * H * I + H * experts + 2 * H
    )  # top_k experts' MLPs, the router, norms
    n = L * active_block + H + V * H
    assert shape.active_params == n
    assert flops_per_token(shape, SEQ) == pytest.approx(6 * n + ATTN)


def test_lora_and_checkpointing_adjust_the_model_count():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        tie_word_embeddings=False,
    )
    shape = _shape_of("llama", cfg)
    n, attn_fwd = shape.active_params, 4 * L * H * SEQ
    # LoRA: forward 2N + input gradients 2N, no weight gradients of the frozen base; 6 per adapter
    # parameter.
    assert (
        flops_per_token(shape, SEQ, lora_rank=8)
        == 4 * n + 6 * 8 * shape.lora_params_per_rank + 2 * attn_fwd
    )
    # Full checkpointing: every block's forward once more (the head is not recomputed).
    assert (
        flops_per_token(shape, SEQ, checkpointed_fraction=1.0)
        == 6 * n + ATTN + 2 * (n - V * H) + attn_fwd
    )
