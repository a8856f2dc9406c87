"""Gradient checkpointing keeps the math and really stores fewer activations for backward."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama, random_batch, saved_tensor_bytes
from onegpu.config import TechniquesConfig
from onegpu.errors import UnavailableError
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.checkpointing import (
    _enable_by_layer,
    apply_checkpointing,
    checkpointed_layers,
)

LAYERS = 4


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    return random_batch(len(tiny_tokenizer), length=64, seed=1)


def _run(model, batch):
    """(bytes kept for backward, loss, gradients) of one training forward/backward."""
    model.train()
    box = {}
    saved = saved_tensor_bytes(model, lambda: box.setdefault("loss", loss_sum(model, batch)))
    box["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return saved, box["loss"].detach(), grads


def _model(tok, mode="off", every=2):
    model = make_tiny_llama(tok, num_hidden_layers=LAYERS)
    return apply_checkpointing(
        model, TechniquesConfig(checkpointing=mode, checkpointing_every=every), "cpu"
    )


@pytest.fixture(scope="module")
def baseline(tiny_tokenizer, batch):
    return _run(_model(tiny_tokenizer), batch)


def _assert_same_math(result, baseline):
    _, loss, grads = result
    assert torch.allclose(loss, baseline[1], rtol=1e-6)
    assert grads.keys() == baseline[2].keys()
    for name, g in grads.items():
        assert torch.allclose(g, baseline[2][name], rtol=1e-4, atol=1e-6), name


def test_modes_select_layers(tiny_tokenizer):
    assert checkpointed_layers(_model(tiny_tokenizer, "off")) == []
    assert len(checkpointed_layers(_model(tiny_tokenizer, "full"))) == LAYERS
    assert len(checkpointed_layers(_model(tiny_tokenizer, "every-n", every=2))) == LAYERS // 2
    assert (
        len(checkpointed_layers(_model(tiny_tokenizer, "every-n", every=3))) == 2
    )  # layers 0 and 3


def test_full_and_every_n_same_gradients_less_memory(tiny_tokenizer, batch, baseline):
    full = _run(_model(tiny_tokenizer, "full"), batch)
    half = _run(_model(tiny_tokenizer, "every-n", every=2), batch)
    _assert_same_math(full, baseline)
    _assert_same_math(half, baseline)
    assert full[0] < half[0] < baseline[0]
    assert full[0] < 0.5 * baseline[0]


def test_offload_moves_saved_layer_inputs_off_the_device(tiny_tokenizer, batch, baseline):
    """The offload hook takes the layer inputs the recompute needs: they no longer count as kept by
    the device-side autograd graph, and gradients are unchanged."""
    full = _run(_model(tiny_tokenizer, "full"), batch)
    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=LAYERS)
    _enable_by_layer(model, every=1, offload=True, device_type="cpu")
    offloaded = _run(model, batch)
    _assert_same_math(offloaded, baseline)
    layer_inputs = (
        LAYERS * batch["input_ids"].numel() * 64 * 4
    )  # (batch x seq x hidden) fp32 per layer
    assert offloaded[0] <= full[0] - layer_inputs + 1


def test_non_reentrant_works_with_frozen_embeddings(tiny_tokenizer, batch):
    """LoRA-like setting: embeddings frozen, so layer inputs do not require grad (peft#1142)."""
    model = _model(tiny_tokenizer, "full")
    for p in model.parameters():
        p.requires_grad_(False)
    q = model.model.layers[1].self_attn.q_proj.weight
    q.requires_grad_(True)
    loss_sum(model, batch).backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_unsupported_model_is_refused():
    class NoCheckpointing(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(UnavailableError, match="does not support gradient checkpointing"):
        apply_checkpointing(NoCheckpointing(), TechniquesConfig(checkpointing="full"), "cpu")
