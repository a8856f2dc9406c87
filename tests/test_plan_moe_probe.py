"""The MoE activation probe in a process that has a GPU, reproduced on CPU.

On an H100 the planner's probe of a small Mixtral predicted 12.1 GB where the card measured
0.50 GB (tests/gpu/test_gpu_plan.py, /work/shared/gpu/h100-20261125/gpu-tier-tests.log): the
experts kernel was chosen by ``torch.cuda.is_available()``, so the probe's CPU copy ran the
per-expert loop, routed by uninitialised weights. Here the same process is simulated by patching
that check; the probe must choose by the planned run's device and route deterministically.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from onegpu.plan import activations as acts
from onegpu.plan.activation_model import Fit
from onegpu.plan.candidate import setup

# The H100's retained bytes for this model at batch 4 x 1024, bf16 autocast over fp32 weights
# (torch.cuda.memory_allocated after the forward, tests/gpu/test_gpu_plan.py, 2026-11-25).
CARD = {"off": 500_816_380, "full": 166_275_580, "every-n": 336_326_140}


def _mixtral():  # tests/gpu/test_gpu_plan.py's
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


@pytest.fixture
def gpu_process(monkeypatch, tmp_path):
    """A process in which torch sees a GPU, with its own activation cache."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))


def test_experts_kernel_follows_the_runs_device_not_the_process(gpu_process):
    from transformers import AutoModelForCausalLM

    from onegpu.techniques.moe import experts_kernel

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_mixtral(), dtype=torch.float32)
    assert model.config._experts_implementation == "grouped_mm"
    assert experts_kernel(model, "cpu") == "grouped_mm"  # CPU grouped_mm takes fp32
    assert experts_kernel(model, "cuda") == "eager"  # CUDA grouped_mm takes bf16 only


def test_probe_routes_the_same_way_to_every_expert(gpu_process):
    model = acts.build_probe_model(_mixtral(), 1, "bf16")
    chosen = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):  # runs after the probe's own hook
            module.register_forward_hook(lambda m, a, out: chosen.append(out[2].clone()))
    first = acts.measure(model, 2, 32, "bf16", skip_matmul=True)
    assert acts.measure(model, 2, 32, "bf16", skip_matmul=True) == first
    assert len(chosen) == 2 and torch.equal(chosen[0], chosen[1])
    assert set(chosen[0].unique().tolist()) == set(range(_mixtral().num_local_experts))


def test_more_fit_points_than_coefficients():
    assert len(acts.POINTS) > len(dataclasses.fields(Fit))


def test_probe_in_a_gpu_process_predicts_what_the_card_measured(gpu_process):
    config = _mixtral()
    am = acts.activation_model(config, setup(4, 1, precision="bf16").techniques)
    assert min(am.block.linear, am.block.const, am.block_ckpt.linear) > 0  # no negative terms
    for mode, measured in CARD.items():
        predicted = am.retained(4, 1024, config.num_hidden_layers, mode, 2)
        assert predicted == pytest.approx(measured, rel=0.05), mode
