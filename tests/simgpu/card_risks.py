"""Bugs found by reading the CUDA-only code, each pinned by a check that failed before its fix.
Runs inside a card's process (test_cards.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from onegpu.config import Config
from onegpu.hardware import detect


def test_tf32_switches_survive_the_new_api(card):
    """transformers' TrainingArguments(tf32=True) sets TF32 through torch's new API; a run started
    afterwards in the same process must neither raise on the legacy read nor leave it changed."""
    from onegpu.techniques.prepare import global_switches

    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # what TrainingArguments(tf32=True) does
    try:
        with global_switches(Config(), detect()):
            assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if card.bf16 else "ieee")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def test_inference_bf16_follows_training_rule(card):
    """Inference picks bf16 only where training does (native bf16, capability 8.0+)."""
    from onegpu.errors import UnavailableError
    from onegpu.infer.loading import _resolve_dtype

    assert _resolve_dtype("auto", "cuda") == (torch.bfloat16 if card.bf16 else torch.float16)
    if card.bf16:
        assert _resolve_dtype("bf16", "cuda") == torch.bfloat16
    else:
        with pytest.raises(UnavailableError, match="capability 7.5"):
            _resolve_dtype("bf16", "cuda")


def test_cpu_adam_needs_its_build_tools(card, tmp_path, monkeypatch, caplog):
    """DeepSpeed's is_compatible() says yes without a compiler; the JIT build would then fail and
    stop the run. Without one, offload falls back to torch's AdamW (with a warning)."""
    from onegpu.techniques import offload

    cfg = Config()
    cfg.techniques.offload = "zero2-cpu"
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, no c++ on it
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level(logging.WARNING):
        assert offload.use_cpu_adam(cfg, detect().is_gpu) is False
    assert "C++ compiler" in caplog.text


def test_accuracy_peak_leaves_out_what_earlier_setups_hold(card):
    """plan/accuracy.step_peak measures one setup: memory the process already holds (a tensor kept
    alive, a reference cycle of an earlier case that only gc frees) must not be in its peak."""
    if card.key != "H100":
        pytest.skip("one card is enough: the measurement does not depend on it")
    import cards
    import transformers

    from onegpu.plan import accuracy
    from onegpu.plan.candidate import setup as candidate

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_cache=False,
    )
    setup = candidate(1, 1, precision="bf16")

    class Cycle:
        pass

    with cards.fake_cuda():
        accuracy.step_peak(
            config, setup, 16, steps=1
        )  # one-time set-up (autocast, kernels' caches)
        clean = accuracy.step_peak(config, setup, 16, steps=1)["peak_bytes"]
        kept = torch.empty(2**20, device="cuda")  # held by the caller: 4 MiB
        cycle = Cycle()
        cycle.me, cycle.t = cycle, torch.empty(2**20, device="cuda")
        del cycle  # an earlier case's garbage: freed only by gc
        busy = accuracy.step_peak(config, setup, 16, steps=1)["peak_bytes"]
        del kept
        assert accuracy.retained_bytes(config, setup, 16) > 0  # what forward keeps for backward
    assert clean > 0 and busy == clean


@pytest.mark.parametrize("case", ["unpadded", "padded", "fp32"])
def test_flash_only_sdpa_says_which_kernel_ran(card, case, caplog):
    """attention=flash without flash_attn: SDPA limited to flash, memory-efficient as fallback. The
    log must name the memory-efficient kernel where it is what runs (padding, fp32, pre-Ampere).
    (The registered attention function is called as a model's attention layer calls it: under fake
    tensors transformers always builds a mask, so a model forward would never be unpadded here.)"""
    import cards

    from onegpu.techniques import attention

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 1

    attention._REPORTED.clear()
    dtype = torch.float32 if case == "fp32" else torch.bfloat16 if card.bf16 else torch.float16
    with cards.fake_cuda(), caplog.at_level(logging.INFO):
        q = torch.empty(2, 2, 16, 32, device="cuda", dtype=dtype)
        mask = (
            torch.ones(2, 1, 16, 16, device="cuda", dtype=torch.bool) if case == "padded" else None
        )
        out, _ = attention._sdpa_flash_attention(Layer(), q, q, q, mask, dropout=0.0)
    assert out.shape == (2, 16, 2, 32)
    ran_flash = case == "unpadded" and card.capability >= (8, 0)
    assert ("memory-efficient kernel, not FlashAttention" in caplog.text) != ran_flash


@pytest.mark.parametrize("precision", ["bf16", "fp32", "bf16-pure"])
def test_moe_experts_kernel_fits_the_weights(card, precision):
    """Mixtral's experts on the card: grouped_mm (CUDA: bf16 only) stopped every step under fp32
    master weights (precision bf16 = autocast, or fp32); those now get the per-expert loop. The
    bf16-pure step runs whole here; the loop's routing is data-dependent (nonzero), which fake
    tensors cannot run, so under fp32 weights the check is the kernel chosen."""
    if card.key != "H100":
        pytest.skip("one Ampere+ card is enough")
    from card_step import _model, step

    from onegpu.config import TechniquesConfig
    from onegpu.techniques.moe import apply_moe_aux_loss
    from onegpu.techniques.precision import weights_dtype

    model = _model(moe=True).to(weights_dtype(precision))
    assert apply_moe_aux_loss(model, "cuda")
    assert model.config._experts_implementation == (
        "grouped_mm" if precision == "bf16-pure" else "eager"
    )
    if precision == "bf16-pure":
        _, opt, _, _ = step(TechniquesConfig(precision=precision), moe=True)
        assert any(s for s in opt.optimizer.state.values())
