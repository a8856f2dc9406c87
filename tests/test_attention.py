"""Attention choice really changes the model's kernel, keeps its outputs, and padding-free packing
keeps documents apart."""

from __future__ import annotations

import logging

import pytest
import torch

from onegpu.data.batches import Collator
from onegpu.config import ModelConfig, TechniquesConfig
from onegpu.hardware import DeviceInfo
from onegpu.models import load_model
from onegpu.techniques import attention as A
from onegpu.techniques.loss import model_inputs

CPU = DeviceInfo("cpu", "CPU", 8 * 2**30)
H100 = DeviceInfo("cuda", "NVIDIA H100", 80 * 2**30, (9, 0))


def _load(path, tok, attn):
    model = load_model(str(path), ModelConfig(), tok, attn_implementation=attn)
    return model.eval()


def test_flash_on_cpu_falls_back_to_sdpa_with_warning(caplog):
    assert A.resolve_attention(TechniquesConfig(attention="flash"), CPU) == "sdpa"
    assert "needs a CUDA GPU" in caplog.text


def test_flash_on_cuda_picks_package_or_sdpa_flash_kernel(monkeypatch):
    flash = TechniquesConfig(attention="flash")
    monkeypatch.setattr(A, "flash_attn_installed", lambda: False)
    assert A.resolve_attention(flash, H100) == A.SDPA_FLASH
    monkeypatch.setattr(A, "flash_attn_installed", lambda: True)
    assert A.resolve_attention(flash, H100) == "flash_attention_2"
    assert A.resolve_attention(TechniquesConfig(attention="eager"), H100) == "eager"
    assert A.resolve_attention(TechniquesConfig(attention="auto"), CPU) == "sdpa"


def test_implementations_switch_and_agree(tiny_model_dir, tiny_tokenizer, monkeypatch):
    A.register_sdpa_flash()
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(torch.backends.cuda.math_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = {}
    for attn in ("eager", "sdpa", A.SDPA_FLASH):
        calls.clear()
        model = _load(tiny_model_dir, tiny_tokenizer, attn)
        assert A.attention_of(model) == attn
        with torch.no_grad():
            logits[attn] = model(input_ids=ids).logits
        n_layers = model.config.num_hidden_layers
        # eager never calls SDPA; plain SDPA may use any kernel; ours forbids the math fallback.
        assert calls == {"eager": [], "sdpa": [True] * n_layers, A.SDPA_FLASH: [False] * n_layers}[attn]
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=1e-5)
    assert torch.allclose(logits["sdpa"], logits[A.SDPA_FLASH], atol=1e-5)


def _doc(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_documents_do_not_see_each_other(tiny_model_dir, tiny_tokenizer, attn):
    model = _load(tiny_model_dir, tiny_tokenizer, attn)
    first = _doc(tiny_tokenizer, "def add(a, b):\n    return a + b\n")
    second = _doc(tiny_tokenizer, "for i in range(10):\n    print(i)\n")
    packed = {"input_ids": first + second, "labels": first + second,
              "position_ids": list(range(len(first))) + list(range(len(second)))}
    collate = Collator(tiny_tokenizer.pad_token_id, multiple=8, position_ids=True)
    batch = collate([packed])
    assert "attention_mask" not in model_inputs(batch)  # the document boundaries come from position_ids
    with torch.no_grad():
        together = model(**model_inputs(batch)).logits[0, len(first): len(first) + len(second)]
        alone = model(input_ids=torch.tensor([second])).logits[0]
        # Without position_ids the second document attends to the first: the logits change.
        crossed = model(input_ids=batch["input_ids"]).logits[0, len(first): len(first) + len(second)]
    assert torch.allclose(together, alone, atol=1e-5)
    assert not torch.allclose(crossed, alone, atol=1e-3)


def test_padding_free_batch_has_the_same_loss_without_padding(tiny_model_dir, tiny_tokenizer):
    """Prompt/completion examples packed into one row: same summed loss and target count as the
    padded batch, fewer positions computed."""
    from onegpu.techniques.loss import IGNORE, count_targets, loss_sum

    model = _load(tiny_model_dir, tiny_tokenizer, "sdpa")
    examples = []
    for prompt, completion in [("def add(a, b):", " return a + b"), ("x =", " 1"), ("for i in", " range(3): pass")]:
        p, c = _doc(tiny_tokenizer, prompt)[:-1], _doc(tiny_tokenizer, completion)
        examples.append({"input_ids": p + c, "labels": [IGNORE] * len(p) + c})
    padded = Collator(tiny_tokenizer.pad_token_id, multiple=8)(examples)
    packed = Collator(tiny_tokenizer.pad_token_id, multiple=8, position_ids=True)(examples)
    assert packed["input_ids"].shape[0] == 1 and packed["input_ids"].numel() < padded["input_ids"].numel()
    assert count_targets(packed["labels"]) == count_targets(padded["labels"])
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    with torch.no_grad():
        assert torch.allclose(loss_sum(model, packed), loss_sum(model, padded), rtol=1e-5)
