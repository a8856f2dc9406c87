"""Activation offload and tiled MLP on a GPU: the device memory alive at the end of the forward
drops by the bytes moved to pinned host memory, the copies run on the side stream overlapped with
compute kernels, and the loss and gradients are the plain run's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from onegpu.config import TechniquesConfig
from onegpu.objectives.sft import loss_sum
from onegpu.techniques.activation_offload import MAX_IN_FLIGHT, ActivationOffload, attached
from onegpu.techniques.prepare import prepare_model

pytestmark = pytest.mark.gpu

TOKENS = 4096


SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=8)


def _model(tok, tokens=TOKENS, shape=SHAPE, **tech):
    from helpers import make_tiny_llama

    model = make_tiny_llama(
        tok,
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
        **shape,
    )
    return prepare_model(model.to("cuda", torch.bfloat16), TechniquesConfig(**tech), "cuda").train()


def _batch(tok, tokens=TOKENS):
    ids = torch.randint(3, len(tok), (1, tokens), generator=torch.Generator().manual_seed(0))
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
    """The device memory alive after the forward drops by what moved (less the copies in flight);
    and the loss and every gradient are the plain run's bit for bit where the kernels are
    deterministic. Offload copies whole storages byte for byte and rebuilds each saved tensor with
    its dtype, size, stride and offset, so it cannot change a value; but PyTorch's flash attention
    backward (the SDPA kernel an H100 runs here) sums dQ with atomics in no fixed order unless
    ``torch.use_deterministic_algorithms(True)`` without warn_only, which the loss's cross_entropy
    (NLLLoss on CUDA) refuses: two plain runs differ in the last bf16 bits themselves (the H100
    showed embed_tokens' gradient a few bf16 ulps off the plain run, the loss equal). The exact
    comparison therefore runs SDPA's math kernel (matmuls and a softmax, a fixed order)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = _batch(tiny_tokenizer)
    plain = _step(_model(tiny_tokenizer), batch)
    model = _model(tiny_tokenizer)
    offload = ActivationOffload(model, min_bytes=1 << 20).attach()
    off = _step(model, batch)
    largest = TOKENS * 2816 * 2  # one (tokens x intermediate) bf16 activation
    assert plain[0] - off[0] >= offload.stats.moved - MAX_IN_FLIGHT * largest
    assert offload.stats.moved > plain[0] / 2
    assert torch.equal(off[1], plain[1])  # the forward reads nothing that moved
    with sdpa_kernel(SDPBackend.MATH):
        plain = _step(_model(tiny_tokenizer), batch)
        model = _model(tiny_tokenizer)
        offload = ActivationOffload(model, min_bytes=1 << 20).attach()
        off = _step(model, batch)
    assert offload.stats.fetched > 0  # what moved came back through the copies
    assert torch.equal(off[1], plain[1])
    assert off[2].keys() == plain[2].keys()
    for name, g in off[2].items():
        assert torch.equal(g, plain[2][name]), name


# Sized so that the copies have compute to hide behind (estimates, not measured): with
# checkpointing, what moves is each block's input (tokens x hidden x 2 bytes, 32 MiB here) while a
# block's forward, recompute and backward do ~8 x 51 M FLOPs a token plus attention: ~37 TFLOP a
# step, some 90 ms on an H100, against ~0.5 GB of copies, 10-20 ms at PCIe speed. The plain
# offload of the test above moves every activation: a 1024-wide block saves ~35 KB a token for
# ~35 MFLOP of forward, ~2.5 TFLOP a step (~5 ms) against 42.7 ms of copies on the H100, so at
# most about a tenth of the copy time can overlap there (3.5 ms did), whatever the mechanism.
OVERLAP_SHAPE = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16
)
OVERLAP_TOKENS = 8192


def test_offload_copies_overlap_compute(tiny_tokenizer):
    """Profiled step of checkpointed blocks with activation offload (the long-context setting):
    the device-to-host and host-to-device copies run on the side stream concurrently with compute
    kernels for most of their time, not serialised between them. The step itself synchronises
    only at its end, as training's does."""
    from torch.profiler import ProfilerActivity, profile

    batch = _batch(tiny_tokenizer, OVERLAP_TOKENS)
    tech = dict(checkpointing="full", activation_offload=True)
    model = _model(tiny_tokenizer, OVERLAP_TOKENS, OVERLAP_SHAPE, **tech)

    def step():
        model.zero_grad(set_to_none=True)
        loss_sum(model, batch, chunk_size=1024).backward()
        torch.cuda.synchronize()

    step()  # warm: the allocators, the pinned host cache, the kernels
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
    stats = attached(model).stats
    assert stats.moved_storages > MAX_IN_FLIGHT and stats.prefetched > 0
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e.time_range for e in events if "Memcpy DtoH" in e.name or "Memcpy HtoD" in e.name]
    kernels = [e.time_range for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    assert copies and kernels
    copy_time = sum(c.elapsed_us() for c in copies)
    overlapped = sum(
        max(0, min(c.end, k.end) - max(c.start, k.start)) for c in copies for k in kernels
    )
    assert overlapped >= 0.5 * copy_time, (overlapped, copy_time)


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
