"""Inference on a CUDA GPU: bf16, bitsandbytes int8/nf4, torchao int8/int4, flash attention, and
static cache + torch.compile. Skipped without a GPU (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import is_quantized_layer
from onegpu.infer import InferConfig, SamplingConfig, generate, load
from onegpu.techniques.quantization import weight_bytes

pytestmark = pytest.mark.gpu

PROMPTS = ["def add(a, b):", "class Point:\n    def", "import os\nprint("]


def _cfg(model_dir, **kw) -> InferConfig:
    return InferConfig(model=str(model_dir), device="cuda", **kw)


def _linears(model):
    return [
        m
        for n, m in model.named_modules()
        if n.endswith(("q_proj", "o_proj", "up_proj", "down_proj"))
    ]


@pytest.fixture(scope="module")
def bf16(tiny_model_dir):
    return load(_cfg(tiny_model_dir, dtype="bf16"))


def test_auto_dtype_is_bf16_on_ampere_and_runs_on_cuda(tiny_model_dir):
    loaded = load(_cfg(tiny_model_dir))
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert loaded.model.dtype == expected and loaded.model.device.type == "cuda"
    out = generate(
        loaded.model, loaded.tokenizer, PROMPTS, SamplingConfig(max_new_tokens=8, greedy=True)
    )
    assert all(c.new_tokens > 0 for c in out)


@pytest.mark.parametrize("kind, cls", [("int8", "Linear8bitLt"), ("nf4", "Linear4bit")])
def test_bitsandbytes_on_cuda(kind, cls, bf16, tiny_model_dir):
    q = load(_cfg(tiny_model_dir, dtype="bf16", quantization=kind))
    layers = _linears(q.model)
    assert all(type(m).__name__ == cls and m.weight.device.type == "cuda" for m in layers)
    assert weight_bytes(q.model) < 0.8 * weight_bytes(bf16.model)
    out = generate(q.model, q.tokenizer, PROMPTS, SamplingConfig(max_new_tokens=8, greedy=True))
    assert all(c.new_tokens > 0 for c in out)


@pytest.mark.parametrize("kind", ["ao-int8", "ao-int8-dynamic", "ao-int4"])
def test_torchao_on_cuda(kind, bf16, tiny_model_dir):
    q = load(_cfg(tiny_model_dir, dtype="bf16", quantization=kind))
    layers = [m for m in _linears(q.model) if m.in_features % 128 == 0 or kind != "ao-int4"]
    assert layers and all(is_quantized_layer(m) for m in layers)
    ids = q.tokenizer(PROMPTS[:1], return_tensors="pt")["input_ids"].cuda()
    ref, out = bf16.model(ids).logits.float(), q.model(ids).logits.float()
    assert (out - ref).abs().max() < 0.2 * ref.abs().max()


def test_static_cache_and_inductor_compile_match_eager(tiny_model_dir):
    """Greedy text must match exactly, so the model runs in fp32: a random bf16 model of hidden size
    64 has near-ties between its top logits that bf16 rounding (kernel order) can flip."""
    fp32 = load(_cfg(tiny_model_dir, dtype="fp32"))
    eager = generate(
        fp32.model, fp32.tokenizer, PROMPTS, SamplingConfig(max_new_tokens=16, greedy=True)
    )
    compiled = generate(
        fp32.model,
        fp32.tokenizer,
        PROMPTS,
        SamplingConfig(max_new_tokens=16, greedy=True, compile="reduce-overhead"),
    )
    assert [c.text for c in compiled] == [c.text for c in eager]
    assert hasattr(fp32.model, "_compiled_call")


def test_flash_attention_loads_in_bf16(tiny_model_dir):
    loaded = load(_cfg(tiny_model_dir, dtype="bf16", attention="flash"))
    from onegpu.techniques.attention import SDPA_FLASH, flash_attn_installed

    # The flash kernel itself: flash_attn's, or SDPA restricted to its FlashAttention kernel (never
    # plain SDPA, which may pick another kernel).
    want = "flash_attention_2" if flash_attn_installed() else SDPA_FLASH
    assert loaded.model.config._attn_implementation == want
    out = generate(
        loaded.model, loaded.tokenizer, PROMPTS[:1], SamplingConfig(max_new_tokens=8, greedy=True)
    )
    assert out[0].new_tokens > 0


def test_device_map_auto_with_gpu_budget_spills_to_cpu(tiny_model_dir, bf16):
    budget = weight_bytes(bf16.model) // 2
    spilled = load(
        InferConfig(
            model=str(tiny_model_dir),
            dtype="bf16",
            device_map="auto",
            max_memory=f"0={budget},cpu=4GiB",
        )
    )
    assert set(spilled.model.hf_device_map.values()) == {0, "cpu"}
    out = generate(
        spilled.model, spilled.tokenizer, PROMPTS[:1], SamplingConfig(max_new_tokens=4, greedy=True)
    )
    assert out[0].new_tokens == 4


def test_the_benchs_memory_breakdown_matches_the_allocator(tmp_path):
    """`onegpu bench infer`'s figures against what is independently known on the card: weights =
    the parameters' bytes (to the allocator's 512-byte rounding per tensor), KV = the cache sized
    to the request, and a setting's peak within the process's own peak."""
    import json

    from onegpu.cli.main import main

    torch.cuda.reset_peak_memory_stats()
    argv = ["bench", "infer", "--model", "tiny", "--vocab_size", "512", "--dtype", "fp32"]
    argv += ["--settings", "engine+fp32", "--batch_size", "2", "--prompt_len", "8"]
    argv += ["--new_tokens", "4", "--sync_every", "2", "--repeats", "1", "--device", "cuda"]
    assert main([*argv, "--out", str(tmp_path), "--name", "m"]) == 0
    process_peak = torch.cuda.max_memory_allocated() / 2**20
    result = json.loads((tmp_path / "m.json").read_text())
    for row in result["results"]:
        mem = row["memory_mb"]
        assert abs(mem["weights"] - row["weight_mb"]) < 1  # allocated by loading vs counted
        assert 0 <= mem["kv"] and mem["workspace"] >= 0
        assert mem["weights"] + mem["kv"] <= mem["peak"] <= process_peak
    engine = next(r for r in result["results"] if r["path"] == "engine")
    assert engine["memory_mb"]["kv"] * 2**20 == 2 * 12 * engine["kv_bytes_per_position"]
