"""The planner on a real GPU: predicted activation bytes and step peak against
torch.cuda.memory_allocated / max_memory_allocated (skipped without a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

from onegpu import hardware
from onegpu.plan import accuracy, memory
from onegpu.plan.activations import activation_model
from onegpu.plan.arch import _shape_of
from onegpu.plan.candidate import setup

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()
    torch.cuda.empty_cache()


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=2048,
    )


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


def test_this_gpu_is_in_the_catalog():
    spec = hardware.spec_from_device(hardware.detect())
    assert spec.memory_gib == pytest.approx(
        torch.cuda.get_device_properties(0).total_memory / 2**30, rel=0.06
    )


@pytest.mark.parametrize("make", [_llama, _mixtral])
@pytest.mark.parametrize("mode", ["off", "full", "every-n", "offload"])
def test_retained_activation_bytes_on_gpu(make, mode):
    config = make()
    c = setup(4, 1, precision="bf16", checkpointing=mode)
    am = activation_model(config, c.techniques)
    measured = accuracy.retained_bytes(config, c, 1024)
    predicted = am.retained(
        4, 1024, config.num_hidden_layers, mode, c.techniques.checkpointing_every
    )
    if mode == "offload":  # block inputs live in host memory: only embedding/head/loss stay
        assert measured <= am.base.at(4, 1024) * 1.10 + 2**20
    else:
        assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize(
    "cand",
    [
        setup(8, 1, precision="bf16"),
        setup(8, 2, precision="bf16", checkpointing="full"),
        setup(16, 1, precision="bf16-pure", checkpointing="every-n"),
        setup(8, 1, precision="bf16", optimizer="adamw-8bit"),
        setup(8, 1, precision="bf16", checkpointing="full", lora={"r": 16}),
    ],
    ids=lambda c: c.label(),
)
def test_step_peak_matches_max_memory_allocated(cand):
    config = _llama()
    shape = _shape_of("llama-gpu", config)
    predicted = memory.estimate(shape, cand, 1024, on_gpu=True).peak
    measured = accuracy.step_peak(config, cand, 1024, steps=2)["peak_bytes"]
    assert predicted == pytest.approx(measured, rel=0.15)
