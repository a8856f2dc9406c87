"""GPU paths of precision, attention kernels, compile, checkpointing offload and the fused loss
(skipped without a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama, random_batch
from onegpu.config import Config, ModelConfig, TechniquesConfig
from onegpu.hardware import detect
from onegpu.objectives.sft import loss_sum

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    torch._dynamo.reset()
    yield
    AcceleratorState._reset_state()
    torch._dynamo.reset()


def _out_dtype(model, batch):
    seen = []
    h = model.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    h.remove()
    return seen[0]


def _prepared(tok, precision):
    from onegpu.training.assemble import make_accelerator

    acc = make_accelerator(Config(), detect(), precision)
    model = make_tiny_llama(tok)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model, opt


def test_fp16_autocast_and_loss_scaling_on_cuda(tiny_tokenizer):
    from onegpu.training.step import train_step

    acc, model, opt = _prepared(tiny_tokenizer, "fp16")
    batch = random_batch(len(tiny_tokenizer), n=4, length=128, device="cuda")
    assert _out_dtype(model, batch) == torch.float16 and acc.scaler is not None
    weight = model.model.layers[0].self_attn.q_proj.weight
    hook = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before, scale = weight.detach().clone(), acc.scaler.get_scale()
    train_step(model, opt, [batch], acc, max_grad_norm=1.0)
    assert torch.equal(weight.detach(), before) and acc.scaler.get_scale() < scale
    hook.remove()


def test_bf16_autocast_on_cuda(tiny_tokenizer):
    if not detect().bf16:
        pytest.skip("GPU without bf16")
    _, model, _ = _prepared(tiny_tokenizer, "bf16")
    assert (
        _out_dtype(model, random_batch(len(tiny_tokenizer), n=4, length=128, device="cuda"))
        == torch.bfloat16
    )


def test_tf32_follows_the_gpu_and_changes_fp32_matmuls():
    """On by default on Ampere+: an fp32 matmul then rounds its inputs to TF32's 10-bit mantissa
    (error ~1e-3 against fp64); switched off it is exact fp32 (~1e-6). Measured, not read off a
    flag."""
    from onegpu.techniques.prepare import global_switches

    dev = detect()
    if not dev.tf32:
        pytest.skip("GPU without TF32")
    torch.manual_seed(0)
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    exact = a.double() @ b.double()

    def rel_error(tf32):
        cfg = Config(techniques=TechniquesConfig(tf32=tf32, compile="off"))
        with global_switches(cfg, dev):
            out = a @ b
            torch.cuda.synchronize()
        return ((out.double() - exact).norm() / exact.norm()).item()

    before = torch.backends.cuda.matmul.fp32_precision
    on, off = rel_error(None), rel_error(False)
    assert on > 1e-4 and off < 1e-5, (on, off)
    assert (
        torch.backends.cuda.matmul.fp32_precision == before
    )  # the run's switch is put back afterwards


def _kernel_names(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.key.lower() for e in prof.key_averages())


def test_sdpa_flash_kernel_runs_and_matches_eager(tiny_model_dir, tiny_tokenizer):
    from onegpu.models import load_model
    from onegpu.techniques.attention import SDPA_FLASH, resolve_attention

    attn = resolve_attention(TechniquesConfig(attention="flash"), detect())
    assert attn in (SDPA_FLASH, "flash_attention_2")
    ids = random_batch(len(tiny_tokenizer), n=4, length=128, device="cuda")["input_ids"]
    models = {
        a: load_model(
            str(tiny_model_dir),
            ModelConfig(),
            tiny_tokenizer,
            dtype=torch.bfloat16,
            attn_implementation=a,
        )
        .cuda()
        .eval()
        for a in ("eager", attn)
    }
    with torch.no_grad():
        ref = models["eager"](input_ids=ids).logits.float()
        out = models[attn](input_ids=ids).logits.float()
        names = _kernel_names(lambda: models[attn](input_ids=ids))
    assert "flash" in names
    assert torch.allclose(out, ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("regional", [True, False])
def test_compile_on_cuda_matches_eager(tiny_tokenizer, regional):
    from onegpu.techniques.compile import apply_compile

    batch = random_batch(len(tiny_tokenizer), n=4, length=128, device="cuda")
    eager = loss_sum(make_tiny_llama(tiny_tokenizer).cuda(), batch)
    model = apply_compile(
        make_tiny_llama(tiny_tokenizer).cuda(),
        TechniquesConfig(compile="default", compile_regional=regional),
        "cuda",
    )
    compiled = loss_sum(model, batch)
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-3)


def _memory_after_forward(model, batch) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = loss_sum(model, batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    return held


def test_checkpointing_modes_hold_less_gpu_memory(tiny_tokenizer):
    from onegpu.techniques.checkpointing import apply_checkpointing

    batch = random_batch(len(tiny_tokenizer), n=8, length=256, device="cuda")
    held = {}
    for mode in ("off", "every-n", "full", "offload"):
        model = make_tiny_llama(tiny_tokenizer, num_hidden_layers=4).cuda().train()
        apply_checkpointing(model, TechniquesConfig(checkpointing=mode), "cuda")
        held[mode] = _memory_after_forward(model, batch)
    assert held["offload"] < held["full"] < held["every-n"] < held["off"]


def test_fused_loss_lowers_gpu_peak(tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer, vocab_size=32768, num_hidden_layers=1).cuda()
    batch = random_batch(len(tiny_tokenizer), n=4, length=512, device="cuda")
    peaks = {}
    for chunk in (0, 1024):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_sum(model, batch, chunk_size=chunk).backward()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - base
    logits_bytes = 4 * 512 * 32768 * 4
    assert peaks[1024] < peaks[0] - logits_bytes


def test_fused_loss_under_bf16_autocast_matches_plain(tiny_tokenizer):
    """As Accelerate runs it: the model's forward under bf16 autocast, the fused head chunks too."""
    model = make_tiny_llama(tiny_tokenizer, vocab_size=32768, num_hidden_layers=2).cuda()
    model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)
    batch = random_batch(len(tiny_tokenizer), length=256, device="cuda")
    grads = {}
    for chunk in (0, 256):
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch, chunk_size=chunk)
        loss.backward()
        grads[chunk] = (
            loss.detach().float(),
            {n: p.grad.float().clone() for n, p in model.named_parameters()},
        )
    assert torch.allclose(grads[0][0], grads[256][0], rtol=2e-2)
    for name, g in grads[0][1].items():
        assert (grads[256][1][name] - g).norm() <= 0.05 * g.norm() + 1e-6, name


def test_fused_loss_needs_no_host_sync(tiny_tokenizer):
    """With the target rows computed on the host (as the training loop does), selecting them and
    the fused head + loss run without a device-to-host sync."""
    from onegpu.objectives.tokens import TARGETS, select_targets, with_target_positions
    from onegpu.techniques.fused_loss import Head as _Head
    from onegpu.techniques.fused_loss import fused_head_loss

    model = make_tiny_llama(tiny_tokenizer).cuda()
    cpu = with_target_positions(random_batch(len(tiny_tokenizer), n=4, length=128))
    batch = {k: v.cuda() for k, v in cpu.items()}
    hidden = torch.randn(
        *batch["input_ids"].shape, model.config.hidden_size, device="cuda", requires_grad=True
    )
    amp = ("cuda", False, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h, y = select_targets(hidden, batch["labels"], batch[TARGETS])
        loss = fused_head_loss(_Head(model), h, y, 64, amp)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hidden.grad is not None and model.lm_head.weight.grad is not None
