"""Autocast's cache of 16-bit weight copies (plan/autocast_cache.py) against a real CPU step.

Under bf16 autocast over fp32 weights with every block checkpointed and the optimizer stepped in
backward, the step's peak is the forward's end: the cache holds a bf16 copy of every block's Linear
weight until the forward returns. Here the copies outweigh the activations many times over (short
rows, wide blocks), so a model without them is far off.
"""

from __future__ import annotations

import pytest
import torch

from helpers import peak_cpu_bytes
from onegpu.plan import memory
from onegpu.plan.arch import _shape_of
from onegpu.plan.autocast_cache import cached_cast_bytes
from onegpu.plan.candidate import setup

ROWS, SEQ = 1, 64


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    )


def _candidate():
    return setup(
        ROWS,
        1,
        precision="bf16",
        checkpointing="full",
        optimizer="adamw",
        optimizer_in_backward=True,
        loss_chunk_size=64,
    )


def _step_peak_above_resident(cache_enabled: bool) -> int:
    """Bytes above weights and optimizer state at the peak of a second training step (training's
    own assembly, Accelerate's bf16 autocast, train_step)."""
    previous = torch.is_autocast_cache_enabled()
    # read when Accelerate makes the autocast region that wraps forward, in prepare
    torch.set_autocast_cache_enabled(cache_enabled)
    try:
        torch.manual_seed(0)
        return _peak()
    finally:
        torch.set_autocast_cache_enabled(previous)


def _peak() -> int:
    from transformers import AutoModelForCausalLM

    from onegpu.config import Config
    from onegpu.hardware import DeviceInfo
    from onegpu.objectives.sft import SFT
    from onegpu.objectives.tokens import TokenLoss
    from onegpu.techniques.optimizers import build_optimizer
    from onegpu.techniques.prepare import prepare_model
    from onegpu.training.assemble import make_accelerator
    from onegpu.training.step import train_step

    cfg = _candidate().apply(Config())
    model = AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    model = prepare_model(model.train(), cfg.techniques, "cpu")
    optimizer = build_optimizer(model, cfg.techniques, cfg.training)
    accelerator = make_accelerator(cfg, DeviceInfo("cpu", "cpu", 0), "bf16")
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = SFT(TokenLoss.for_run(cfg.techniques, 512, False, False))
    ids = torch.randint(0, 512, (ROWS, SEQ))
    micro = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]

    def step():
        train_step(model, optimizer, micro, accelerator, 0.0, loss)

    step()  # the optimizer state exists from here on, as in every later step
    return peak_cpu_bytes(step)


@pytest.fixture(scope="module")
def measured() -> dict:
    return {on: _step_peak_above_resident(on) for on in (True, False)}


def _predicted_above_resident() -> float:
    shape, c = _shape_of("cache", _config()), _candidate()
    est = memory.estimate(shape, c, SEQ, on_gpu=False)
    return est.peak - est.components["weights"] - est.components["optimizer"]


def test_the_cached_copies_make_the_peak(measured):
    """Switching autocast's cache off (nothing else changes) lowers the step's peak by most of the
    copies the model counts: the rest is the backward's own peak, which then takes over."""
    cached = cached_cast_bytes(_shape_of("cache", _config()), _candidate())
    assert measured[True] - measured[False] > 0.5 * cached


def test_peak_with_the_step_in_backward_under_autocast_within_10_percent(measured):
    assert _predicted_above_resident() == pytest.approx(measured[True], rel=0.10)
