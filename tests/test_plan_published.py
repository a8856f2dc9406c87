"""The planner against published measurements: default efficiency per GPU class, compile and
QLoRA speed factors, compile's memory, LoRA adapter dtype, and torchtune's Llama-3.2-3B table."""

from __future__ import annotations

import pytest

import torchtune_rows
from onegpu.config import Config
from onegpu.hardware import find_gpu
from onegpu.plan import memory, published, speed
from onegpu.plan.arch import _shape_of, model_shape
from onegpu.plan.candidate import setup


def _llama(config: dict):
    from transformers import LlamaConfig

    return _shape_of("published", LlamaConfig(**config))


@pytest.mark.parametrize("capability", sorted(published.EFFICIENCY_RUNS))
def test_each_default_efficiency_is_what_our_model_derives_from_its_published_run(capability):
    run = published.EFFICIENCY_RUNS[capability]
    spec = find_gpu(run.gpu)
    assert spec.capability == capability
    c = setup(run.micro_batch, 1, precision="bf16-pure", tiled_mlp="off")  # none of them tiled
    derived = speed.compute_efficiency(_llama(run.config), c, run.seq_len, spec, run.tokens_per_s)
    assert derived == pytest.approx(run.efficiency, rel=0.01)


def test_default_efficiency_follows_the_gpu_class_until_a_probe(monkeypatch, tmp_path):
    monkeypatch.setenv(
        "ONEGPU_CACHE", str(tmp_path)
    )  # no calibration another test's probe may have stored
    shape, c = model_shape("tiny"), setup(16, 1, precision="bf16")
    for gpu, expected in (("A100-80GB", 0.599), ("H100", 0.36), ("A10G", speed.DEFAULT_EFFICIENCY)):
        eff, calibrated = speed.base_efficiency(find_gpu(gpu), "bf16")
        assert (eff, calibrated) == (pytest.approx(expected), False)
        label = speed.estimate(shape, c, 256, find_gpu(gpu)).assumptions[0]
        assert ("published:" in label) == (gpu != "A10G") and "no probe" in label
    assert speed.base_efficiency(find_gpu("A100-80GB"), "fp32")[0] == speed.DEFAULT_EFFICIENCY


def test_compile_and_qlora_speed_factors_are_torchtunes_measurements():
    assert speed.COMPILE_SPEEDUP == pytest.approx(1.27, abs=0.005)  # 7,075 -> 8,998 tokens/s
    assert speed.QLORA_SLOWDOWN == pytest.approx(0.98, abs=0.005)  # LoRA 8,210 vs QLoRA 8,035
    c = setup(8, 1, precision="bf16", compile="default", lora={"r": 16, "quantize_base": "nf4"})
    assert speed.method_factor(c) == pytest.approx(speed.COMPILE_SPEEDUP * speed.QLORA_SLOWDOWN)
    text = " ".join(speed.assumptions(c, find_gpu("A100-80GB"), calibrated=True))
    assert "torchtune" in text and "elementwise" in text


def test_bf16_adapters_halve_adapter_weights_grads_and_adam_state():
    shape = model_shape("tiny")
    fp32 = setup(4, 1, precision="bf16", lora={"r": 8, "dtype": "fp32"})
    bf16 = setup(4, 1, precision="bf16", lora={"r": 8, "dtype": "bf16"})
    n = memory.lora_params(shape, fp32)
    assert memory.grad_bytes(shape, fp32) == 4 * n and memory.grad_bytes(shape, bf16) == 2 * n
    assert memory.optimizer_bytes(shape, bf16) == 2 * 2 * n
    assert memory.weight_bytes(shape, fp32) - memory.weight_bytes(shape, bf16) == 2 * n
    auto_pure = setup(4, 1, precision="bf16-pure", lora={"r": 8})  # lora.dtype auto
    assert (
        auto_pure.adapter_dtype == "bf16"
        and setup(4, 1, precision="bf16", lora={"r": 8}).adapter_dtype == "fp32"
    )
    assert "bf16" in bf16.label() and bf16.apply(Config()).techniques.lora.dtype == "bf16"


def test_compiled_blocks_keep_less_than_eager_ones():
    """Compile's memory mechanism, on a small Llama: a compiled block keeps fewer bytes (elementwise
    intermediates recomputed), but at least its matmul outputs and inputs."""
    from transformers import LlamaConfig

    from onegpu.plan.activations import activation_model

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    acts = activation_model(cfg, setup(2, precision="bf16-pure").techniques)
    eager, compiled = acts.block.at(2, 256), acts.block_compiled.at(2, 256)
    tokens, h, i = 2 * 256, 128, 384
    # q, k, v, o_proj input, gate, up, down input, the norms' inputs: bf16 (2 B) each.
    matmul_io = tokens * 2 * (h + 2 * 64 + h + 3 * i + 2 * h)
    assert matmul_io * 0.8 < compiled < eager
    assert acts.retained(2, 256, 2, compiled=True) < acts.retained(2, 256, 2)


def test_torchtune_packed_and_compile_rows_within_10_percent():
    """The cheap rows of results/plan_vs_published.md (one activation fit, no chunked loss):
    torchtune's Llama-3.2-3B full fine-tune, 60.0 GiB packed and 51.0 GiB with compile."""
    result = torchtune_rows.predict(["packed", "compile"])
    by = {r["key"]: r for r in result["rows"]}
    assert result["params"] == pytest.approx(3.21e9, rel=0.01)
    for key in ("packed", "compile"):
        assert 0.9 <= by[key]["ratio"] <= 1.1, by[key]
    saved = 1 - by["compile"]["predicted_gib"] / by["packed"]["predicted_gib"]
    published_saving = 1 - published.COMPILE_MEMORY_CHECK[1] / published.COMPILE_MEMORY_CHECK[0]
    assert saved == pytest.approx(published_saving, abs=0.05)  # -14.9% published
