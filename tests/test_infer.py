"""Loading for inference: run/model/adapter directories, dtype, attention, quantization,
placement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import is_quantized_layer
from onegpu.errors import ConfigError, ModelError, UnavailableError
from onegpu.infer import InferConfig, load, parse_max_memory, resolve_model
from onegpu.techniques.quantization import weight_bytes


@pytest.fixture(scope="module")
def fp32(tiny_model_dir):
    return load(InferConfig(model=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def ids(fp32):
    return fp32.tokenizer(["def add(a, b):\n    return a + b"], return_tensors="pt")["input_ids"]


def _linears(model):
    return [
        m
        for n, m in model.named_modules()
        if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"))
    ]


def test_run_dir_resolves_to_its_final_model(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "final")
    assert resolve_model(str(tmp_path / "run")) == (str(tmp_path / "run" / "final"), None)
    loaded = load(InferConfig(model=str(tmp_path / "run")))
    assert loaded.source.endswith("final") and loaded.model.config.num_hidden_layers == 2


def test_missing_or_wrong_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load(InferConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="neither config.json nor adapter_config.json") as err:
        load(InferConfig(model=str(tmp_path / "empty")))
    assert err.value.hint
    with pytest.raises(ConfigError, match="no model"):
        load(InferConfig())


def test_fp32_default_on_cpu_and_bf16_on_request(fp32, tiny_model_dir):
    assert fp32.device == "cpu" and fp32.model.dtype == torch.float32
    bf16 = load(InferConfig(model=str(tiny_model_dir), dtype="bf16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert weight_bytes(bf16.model) < 0.51 * weight_bytes(fp32.model)  # fp32 rotary buffers remain


def test_attention_choice_reaches_the_model(fp32, tiny_model_dir):
    assert fp32.model.config._attn_implementation == "sdpa"
    eager = load(InferConfig(model=str(tiny_model_dir), attention="eager"))
    assert eager.model.config._attn_implementation == "eager"
    with pytest.raises(UnavailableError, match="flash attention needs a CUDA GPU"):
        load(InferConfig(model=str(tiny_model_dir), attention="flash"))


@pytest.mark.parametrize(
    "kind, cls", [("int8", "Linear8bitLt"), ("nf4", "Linear4bit"), ("fp4", "Linear4bit")]
)
def test_bitsandbytes_quantizes_the_linears(kind, cls, fp32, ids, tiny_model_dir):
    q = load(InferConfig(model=str(tiny_model_dir), quantization=kind, int8_threshold=4.0))
    layers = _linears(q.model)
    assert layers and all(type(m).__name__ == cls and is_quantized_layer(m) for m in layers)
    weight = layers[0].weight
    if kind == "int8":
        assert (
            weight.dtype == torch.int8
            and q.model.config.quantization_config.llm_int8_threshold == 4.0
        )
    else:
        assert weight.dtype == torch.uint8 and weight.quant_state.quant_type == kind
        assert weight.quant_state.nested  # double quantization of the scales
        assert layers[0].compute_dtype == torch.float32
    assert weight_bytes(q.model) < 0.75 * weight_bytes(fp32.model)
    ref, out = fp32.model(ids).logits, q.model(ids).logits
    assert (out - ref).abs().max() < 0.5 * ref.abs().max()  # still the same model, approximately


@pytest.mark.parametrize("kind", ["ao-int8", "ao-int8-dynamic"])
def test_torchao_int8_swaps_weights_for_quantized_tensors(kind, fp32, ids, tiny_model_dir):
    from torchao.utils import TorchAOBaseTensor

    q = load(InferConfig(model=str(tiny_model_dir), quantization=kind))
    layers = _linears(q.model)
    assert layers and all(
        isinstance(m.weight, TorchAOBaseTensor) and is_quantized_layer(m) for m in layers
    )
    assert not is_quantized_layer(q.model.lm_head)  # logits stay full precision
    assert weight_bytes(q.model) < 0.75 * weight_bytes(fp32.model)
    ref, out = fp32.model(ids).logits, q.model(ids).logits
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_torchao_int4_on_cpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(UnavailableError, match="int4") as err:
        load(InferConfig(model=str(tiny_model_dir), quantization="ao-int4"))
    assert "ao-int8" in err.value.hint


def test_max_memory_parsing():
    assert parse_max_memory("0=6GiB, cuda:1=8GiB,cpu=24GiB") == {
        0: "6GiB",
        1: "8GiB",
        "cpu": "24GiB",
    }
    assert parse_max_memory(None) is None
    with pytest.raises(ConfigError, match="max_memory"):
        parse_max_memory("cpu:24GiB")


def test_device_map_auto_spills_layers_past_the_memory_budget(tmp_path, fp32, ids, tiny_model_dir):
    budget = weight_bytes(fp32.model) // 2  # room for the embeddings, not the layers
    spilled = load(
        InferConfig(
            model=str(tiny_model_dir),
            device_map="auto",
            max_memory=f"cpu={budget}",
            offload_folder=str(tmp_path / "offload"),
        )
    )
    placement = set(spilled.model.hf_device_map.values())
    assert placement == {"cpu", "disk"}
    assert torch.allclose(spilled.model(ids).logits, fp32.model(ids).logits, atol=1e-5)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir):
    """A LoRA adapter with non-zero B matrices (so it changes the outputs), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(1)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    path = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(str(path))
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_model_dir)
    return path


def test_lora_adapter_applied_then_merged(adapter_dir, fp32, ids, tiny_model_dir):
    applied = load(InferConfig(model=str(adapter_dir)))  # the adapter dir names its base model
    assert any(
        type(m).__name__ == "Linear" and type(m).__module__.startswith("peft")
        for m in applied.model.modules()
    )
    merged = load(
        InferConfig(model=str(tiny_model_dir), adapter=str(adapter_dir), merge_adapter=True)
    )
    assert not any(type(m).__module__.startswith("peft") for m in merged.model.modules())
    a, m, base = applied.model(ids).logits, merged.model(ids).logits, fp32.model(ids).logits
    assert torch.allclose(a, m, atol=1e-4) and not torch.allclose(a, base, atol=1e-3)
    with pytest.raises(ConfigError, match="itself an adapter"):
        load(InferConfig(model=str(adapter_dir), adapter=str(adapter_dir)))


def test_flash_resolves_as_training_does():
    """An explicit flash choice means the flash kernel itself (flash_attn's, else SDPA held to its
    FlashAttention kernel), by the same resolution training uses; never plain SDPA."""
    import torch

    from onegpu.infer.loading import _attention
    from onegpu.techniques.attention import (
        SDPA_FLASH,
        attention_implementation,
        flash_attn_installed,
    )

    want = "flash_attention_2" if flash_attn_installed() else SDPA_FLASH
    assert (
        _attention("flash", "cuda", torch.bfloat16)
        == attention_implementation("flash", "cuda")
        == want
    )
    assert (
        _attention("auto", "cpu", torch.float32) == "sdpa"
        and _attention("eager", "cpu", torch.float32) == "eager"
    )


def test_attention_auto_resolves_per_model_as_training_does(tmp_path, tiny_tokenizer, caplog):
    """Gemma-2's class refuses SDPA: auto loads it with eager (one log line), an explicit sdpa is
    the same ConfigError training gives."""
    import logging

    from transformers import AutoModelForCausalLM, Gemma2Config

    tok = tiny_tokenizer
    config = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="onegpu.techniques.attention"):
        loaded = load(InferConfig(model=str(tmp_path)))
    assert loaded.model.config._attn_implementation == "eager"
    assert [r.getMessage() for r in caplog.records if r.name == "onegpu.techniques.attention"] == [
        "attention=auto: gemma2 (Gemma2ForCausalLM) does not support sdpa; using eager"
    ]
    with pytest.raises(
        ConfigError, match=r"attention=sdpa is not supported by gemma2 .*it supports"
    ):
        load(InferConfig(model=str(tmp_path), attention="sdpa"))
