"""The planner's MoE activation probe in a card's process: the twin of
tests/gpu/test_gpu_plan.py::test_retained_activation_bytes_on_gpu[*-_mixtral], which failed on an
H100 (12.1 GB predicted against 0.50 GB measured) because the probe chose the experts kernel by
the process having a GPU. Here torch sees a card as it did there. The card's own forward cannot be
run: the per-expert loop routes by value (nonzero), which fake tensors do not hold; so the probe is
held to what the H100 measured for the same model and batch."""

from __future__ import annotations

import os

import cards
import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get(cards.ENV_CARD) != "H100", reason="the H100 is the card that measured it"
)

# tests/gpu/test_gpu_plan.py on an H100 (2026-11-25, its gpu-tier-tests.log): retained bytes,
# batch 4 x 1024, bf16 autocast over fp32 weights (as in tests/test_plan_moe_probe.py)
MEASURED = {"off": 500_816_380, "full": 166_275_580, "every-n": 336_326_140}


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=8192,
        max_position_embeddings=2048,
    )


def test_the_probe_in_a_card_process_predicts_the_cards_bytes(monkeypatch, tmp_path):
    from onegpu.plan.activations import activation_model
    from onegpu.plan.candidate import setup

    assert torch.cuda.is_available()  # the process the H100 run had
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # measured here, not read from a cache
    config = _mixtral()
    c = setup(4, 1, precision="bf16")
    am = activation_model(config, c.techniques)
    for mode, measured in MEASURED.items():
        predicted = am.retained(4, 1024, config.num_hidden_layers, mode, 2)
        assert predicted == pytest.approx(measured, rel=0.05), mode


def test_a_card_run_of_fp32_weights_gets_the_per_expert_loop():
    from transformers import AutoModelForCausalLM

    from onegpu.techniques.moe import experts_kernel

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_mixtral(), dtype=torch.float32)
    assert experts_kernel(model, "cuda") == "eager"
    assert experts_kernel(model, "cpu") == "grouped_mm"
