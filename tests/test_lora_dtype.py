"""techniques.lora.dtype: adapters (and their gradients and optimizer state) in bf16 or fp32."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import LoraConfig, TechniquesConfig, TrainingConfig
from onegpu.errors import ConfigError
from onegpu.techniques.lora import adapter_dtype, apply_lora
from onegpu.techniques.optimizers import build_optimizer

pytest.importorskip("peft")


def _adapted(tok, dtype: str, precision: str = "fp32", base=torch.float32):
    model = make_tiny_llama(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1).to(base)
    tcfg = TechniquesConfig(precision=precision, lora=LoraConfig(enabled=True, r=4, dtype=dtype))
    return apply_lora(model, tcfg)


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_bf16_adapters_their_grads_and_adam_state_are_bf16_and_the_model_trains(tiny_tokenizer):
    torch.manual_seed(0)
    model = _adapted(tiny_tokenizer, "bf16")
    trainable = _trainable(model)
    assert trainable and {p.dtype for p in trainable.values()} == {torch.bfloat16}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.float32}  # only the adapters changed dtype
    opt = build_optimizer(model, TechniquesConfig(), TrainingConfig(lr=2e-2, weight_decay=0.0))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 16), generator=g)
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert {p.grad.dtype for p in trainable.values()} == {torch.bfloat16}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    states = [
        t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1
    ]
    assert states and {t.dtype for t in states} == {torch.bfloat16}
    assert losses[-1] < losses[0] - 0.05


def test_fp32_adapters_on_a_bf16_base(tiny_tokenizer):
    """PEFT's own upcast, kept for dtype=fp32: a bf16-pure model with fp32 adapters."""
    model = _adapted(tiny_tokenizer, "fp32", "bf16-pure", torch.bfloat16)
    assert {p.dtype for p in _trainable(model).values()} == {torch.float32}


@pytest.mark.parametrize(
    "precision, expected",
    [("bf16-pure", "bf16"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32")],
)
def test_auto_is_bf16_only_when_the_whole_model_is_bf16(precision, expected):
    assert adapter_dtype("auto", precision) == expected


def test_auto_under_bf16_pure_gives_bf16_adapters(tiny_tokenizer):
    model = _adapted(tiny_tokenizer, "auto", "bf16-pure", torch.bfloat16)
    assert {p.dtype for p in _trainable(model).values()} == {torch.bfloat16}


def test_bf16_adapters_with_fp16_compute_is_an_error():
    with pytest.raises(ConfigError, match="lora.dtype=bf16"):
        adapter_dtype("bf16", "fp16")
