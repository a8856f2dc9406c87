"""Activation offload and tiled MLP on a GPU: the device memory alive at the end of the forward
drops by the bytes moved to pinned host memory, the copies run on the side stream overlapped with
compute kernels, and the loss and gradients are the plain run's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from onegpu.config import TechniquesConfig
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.activation_offload import MAX_IN_FLIGHT, ActivationOffload
from onegpu.techniques.prepare import prepare_model

pytestmark = pytest.mark.gpu

TOKENS = 4096


def _model(tok, **tech):
    from helpers import make_tiny_llama

    model = make_tiny_llama(
        tok,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=TOKENS,
        attn_implementation="sdpa",
    )
    return prepare_model(model.to("cuda", torch.bfloat16), TechniquesConfig(**tech), "cuda").train()


def _batch(tok):
    ids = torch.randint(3, len(tok), (1, TOKENS), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids.cuda(), "labels": ids.cuda()}


def _step(model, batch):
    """(device bytes alive after the forward, loss, gradients)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = loss_sum(model, batch, chunk_size=1024)
    torch.cuda.synchronize()
    alive = torch.cuda.memory_allocated() - base
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return alive, loss.detach().float(), grads


def test_offload_frees_device_memory_and_keeps_the_math(tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    plain = _step(_model(tiny_tokenizer), batch)
    model = _model(tiny_tokenizer)
    offload = ActivationOffload(model, min_bytes=1 << 20).attach()
    off = _step(model, batch)
    largest = TOKENS * 2816 * 2  # one (tokens x intermediate) bf16 activation
    assert plain[0] - off[0] >= offload.stats.moved - MAX_IN_FLIGHT * largest
    assert offload.stats.moved > plain[0] / 2
    assert torch.equal(off[1], plain[1])  # the same kernels on the same values
    for name, g in off[2].items():
        assert torch.equal(g, plain[2][name]), name


def test_offload_copies_overlap_compute(tiny_tokenizer):
    """Profiled step: the device-to-host and host-to-device copies run concurrently with compute
    kernels for most of their time (the side stream), not serialised between them."""
    from torch.profiler import ProfilerActivity, profile

    batch = _batch(tiny_tokenizer)
    model = _model(tiny_tokenizer, activation_offload=True)
    _step(model, batch)  # warm: allocator, pinned host cache, kernels
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, batch)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e.time_range for e in events if "Memcpy DtoH" in e.name or "Memcpy HtoD" in e.name]
    kernels = [e.time_range for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    copy_time = sum(c.elapsed_us() for c in copies)
    overlapped = sum(
        max(0, min(c.end, k.end) - max(c.start, k.start)) for c in copies for k in kernels
    )
    assert overlapped >= 0.5 * copy_time


def test_tiled_mlp_lowers_the_step_peak(tiny_tokenizer):
    """Per layer, four (tokens x intermediate) bf16 tensors are no longer kept: the step's peak
    drops by at least that, with the same loss."""
    batch = _batch(tiny_tokenizer)
    peaks, losses = [], []
    for mode in ("off", "on"):
        model = _model(tiny_tokenizer, tiled_mlp=mode)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        losses.append(_step(model, batch)[1])
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
    assert peaks[0] - peaks[1] >= 6 * 4 * TOKENS * 2816 * 2 * 0.9
    assert torch.allclose(losses[0], losses[1], rtol=2e-2)
