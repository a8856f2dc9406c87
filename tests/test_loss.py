"""Chunked cross-entropy: same loss and gradients as the plain loss, lower peak memory, and models
whose logits it cannot reproduce are refused."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from onegpu.errors import UnavailableError
from onegpu.techniques.loss import IGNORE, count_targets, loss_sum, model_inputs


def _batch(vocab, n=2, length=48, masked_prefix=5):
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :masked_prefix] = IGNORE  # prompt tokens do not count
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _loss_and_grads(model, batch, chunk):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, batch, chunk_size=chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_chunked_loss_equals_plain_loss_and_gradients(tiny_tokenizer, chunk):
    model = make_tiny_llama(tiny_tokenizer)
    batch = _batch(len(tiny_tokenizer))
    plain, g_plain = _loss_and_grads(model, batch, 0)
    chunked, g_chunked = _loss_and_grads(model, batch, chunk)
    assert torch.allclose(plain, chunked, rtol=1e-5)
    assert g_plain.keys() == g_chunked.keys()
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_chunked[name], rtol=1e-4, atol=1e-6), name


def test_chunked_loss_keeps_the_forward_autocast(tiny_tokenizer):
    """Under bf16 autocast (as Accelerate runs the forward) the chunks' head matmul runs in bf16 too."""
    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    batch = _batch(len(tiny_tokenizer), length=16)
    head_dtypes = []
    model.lm_head.register_forward_hook(lambda m, i, o: head_dtypes.append(o.dtype))
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # only the forward, like Accelerate
    plain = loss_sum(model, batch)
    chunked = loss_sum(model, batch, chunk_size=8)
    chunked.backward()  # the recomputed chunks run under the same autocast
    assert len(head_dtypes) > 4 and set(head_dtypes) == {torch.bfloat16}
    assert torch.allclose(plain, chunked, rtol=1e-2)


def test_softcapped_model_handled(tiny_tokenizer):
    """Gemma-2-style final logit soft-capping is reproduced, so the loss is still exact."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
        pad_token_id=tiny_tokenizer.pad_token_id))
    batch = _batch(len(tiny_tokenizer), length=16)
    plain, _ = _loss_and_grads(model, batch, 0)
    chunked, _ = _loss_and_grads(model, batch, 5)
    assert torch.allclose(plain, chunked, rtol=1e-5)


def test_unknown_logit_transform_is_refused(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=1)
    original = model.forward

    def scaled_forward(*args, **kwargs):  # a model that post-processes its logits in forward
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    model.forward = scaled_forward
    with pytest.raises(UnavailableError, match="loss_chunk_size"):
        loss_sum(model, _batch(len(tiny_tokenizer), length=8), chunk_size=4)


def _peak_cpu_bytes(fn) -> int:
    """Peak bytes held by torch's CPU allocator while ``fn()`` runs, from the profiler's trace of
    every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def test_chunked_loss_lowers_peak_memory(tiny_tokenizer):
    """A large vocabulary makes the logits dominate, as in real LLMs (transformers#30860)."""
    vocab = 16384
    model = make_tiny_llama(tiny_tokenizer, vocab_size=vocab, num_hidden_layers=1)
    batch = _batch(vocab, n=2, length=256, masked_prefix=0)
    peaks = {}
    for chunk in (0, 64):
        model.zero_grad(set_to_none=True)
        peaks[chunk] = _peak_cpu_bytes(lambda: loss_sum(model, batch, chunk_size=chunk).backward())
    logits_bytes = 2 * 256 * vocab * 4  # one fp32 copy of the full logits
    assert peaks[0] > 2 * logits_bytes  # logits, their softmax and gradient coexist
    assert peaks[64] < peaks[0] - logits_bytes


def test_model_inputs_and_count_targets():
    ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4]])
    assert count_targets(labels) == 2
    plain = model_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    assert set(plain) == {"input_ids", "attention_mask", "use_cache"} and plain["use_cache"] is False
    packed = model_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                           "position_ids": torch.tensor([[0, 1, 0, 1]])})
    assert "attention_mask" not in packed and "position_ids" in packed
