"""What a user of a card is told where a GPU-only path cannot run as asked: `onegpu doctor`'s
findings on a machine whose GPU libraries are CPU builds, and the refusals of flash attention that
only a GPU reaches. Runs inside a card's process (these branch on a card being there, not on
which it is: every card, but the inference load on the H100 only)."""

from __future__ import annotations

import importlib.util
import os

import cards
import pytest
import torch


def test_doctor_flags_gpu_libraries_built_for_the_cpu(card):
    """On a GPU machine with the CPU builds this environment has, doctor says what is missing and
    how to fix it, instead of the CPU-only note a machine without a GPU gets."""
    from onegpu.cli import doctor

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed here: doctor reports it as present")
    triton = doctor.check_triton()
    assert not triton.ok and triton.detail == (
        "not installed: torch.compile cannot generate GPU kernels"
    )
    assert "pip install triton" in triton.hint
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed here")
    bnb = doctor.check_bitsandbytes()
    assert not bnb.ok and bnb.detail.endswith("loaded its CPU library only, GPU kernels missing")
    assert "CUDA-enabled wheel" in bnb.hint


@pytest.mark.skipif(
    os.environ.get(cards.ENV_CARD) != "H100",
    reason="the refusal does not depend on the card; it loads a saved model (the H100 has one)",
)
def test_inference_refuses_flash_attention_in_fp32(tiny_model_dir):
    """`onegpu generate --attention flash --dtype fp32` on the card: one error naming the dtype and
    the fix, before any weight is loaded."""
    from onegpu.errors import ConfigError
    from onegpu.infer.loading import InferConfig, load

    cfg = InferConfig(model=str(tiny_model_dir), attention="flash", dtype="fp32")
    with pytest.raises(ConfigError, match=r"fp16/bf16 only, not torch\.float32") as err:
        load(cfg)
    assert "--dtype bf16" in err.value.hint


def test_flash_refused_for_a_model_without_fused_attention(card):
    """attention=flash on the card for a model class with neither flash_attention_2 nor SDPA
    support: refused with what it supports, rather than run on a kernel it lacks."""
    from onegpu.errors import ConfigError
    from onegpu.techniques.attention import ModelKernels, attention_implementation

    model = ModelKernels("oldnet", "OldNetForCausalLM", flash=False, sdpa=False)
    with pytest.raises(ConfigError, match=r"attention=flash is not supported by oldnet") as err:
        attention_implementation("flash", "cuda", card.name, model, half=True)
    assert "it supports eager" in str(err.value) and "attention=auto" in err.value.hint


def test_torchao_int4_on_the_card_needs_bf16(card):
    """`--quantization ao-int4` on a card: fp16 activations are refused with the fix (tinygemm
    takes bf16 only); bf16 gets the tile-packed int4 config. Quantizing with it needs the CUDA
    kernel itself, which has no fake: that stays out of the tier."""
    from onegpu.errors import UnavailableError
    from onegpu.hardware import detect
    from onegpu.techniques.quantization import torchao_config

    pytest.importorskip("torchao")
    device = detect().type
    with pytest.raises(UnavailableError, match="needs bf16 activations") as err:
        torchao_config("ao-int4", device, torch.float16)
    assert "--dtype bf16" in err.value.hint
    config = torchao_config("ao-int4", device, torch.bfloat16)
    assert type(config).__name__ == "Int4WeightOnlyConfig" and config.group_size == 128
