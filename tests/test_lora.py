"""LoRA / DoRA / QLoRA adapters: what trains, what stays frozen, how they save, reload and merge."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import random_batch
from onegpu import models
from onegpu.config import LoraConfig, ModelConfig, TechniquesConfig, TrainingConfig
from onegpu.errors import ConfigError
from onegpu.techniques.lora import apply_lora, quantization_config, save_merged
from onegpu.techniques.optimizers import build_optimizer

pytest.importorskip("peft")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load(model_dir, tok, quant=None):
    return models.load_model(
        str(model_dir),
        ModelConfig(name=str(model_dir)),
        tok,
        extra={"quantization_config": quant} if quant else None,
    )


def _tcfg(**lora):
    return TechniquesConfig(lora=LoraConfig(enabled=True, r=4, **lora))


def _train(model, batch, steps=8, lr=1e-2):
    opt = build_optimizer(model, TechniquesConfig(), TrainingConfig(lr=lr, weight_decay=0.0))
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss  # labels: the input ids
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def test_lora_trains_only_adapters_and_leaves_base_untouched(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    model = _load(tiny_model_dir, tiny_tokenizer)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    model = apply_lora(model, _tcfg())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    cfg = model.config
    dims = {
        "q_proj": (64, 64),
        "k_proj": (64, 32),
        "v_proj": (64, 32),
        "o_proj": (64, 64),
        "gate_proj": (64, cfg.intermediate_size),
        "up_proj": (64, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, 64),
    }
    expected = cfg.num_hidden_layers * sum(4 * (i + o) for i, o in dims.values())  # r * (in + out)
    assert sum(p.numel() for p in trainable.values()) == expected
    losses = _train(model, random_batch(len(tiny_tokenizer), n=4, length=24))
    assert losses[-1] < losses[0] - 0.1
    after = model.get_base_model().state_dict()
    for name, before in base_before.items():
        key = (
            name.replace(".weight", ".base_layer.weight")
            if any(t in name for t in LINEARS)
            else name
        )
        torch.testing.assert_close(after[key], before, rtol=0, atol=0)
    from peft import PeftModel

    model.save_pretrained(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(
        _load(tiny_model_dir, tiny_tokenizer), str(tmp_path / "adapter")
    )
    batch = random_batch(len(tiny_tokenizer), n=4, length=24)
    torch.testing.assert_close(_logits(reloaded, batch), _logits(model, batch), rtol=0, atol=0)


def test_named_targets_and_unknown_target_error(tiny_model_dir, tiny_tokenizer):
    model = apply_lora(_load(tiny_model_dir, tiny_tokenizer), _tcfg(targets="q_proj, v_proj"))
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1]
        for n, _ in model.named_parameters()
        if "lora_A" in n
    }
    assert adapted == {"q_proj", "v_proj"}
    with pytest.raises(ConfigError, match="qproj matches no linear layer") as err:
        apply_lora(_load(tiny_model_dir, tiny_tokenizer), _tcfg(targets="q_proj,qproj"))
    assert "q_proj" in err.value.hint and "down_proj" in err.value.hint


def test_dora_adds_trainable_magnitude_vectors(tiny_model_dir, tiny_tokenizer):
    model = apply_lora(_load(tiny_model_dir, tiny_tokenizer), _tcfg(dora=True))
    mags = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(mags) == model.config.num_hidden_layers * len(LINEARS)
    q = next(p for n, p in mags.items() if "q_proj" in n)
    assert q.ndim == 1 and q.shape[0] == 64 and q.requires_grad
    losses = _train(model, random_batch(len(tiny_tokenizer), n=4, length=24), steps=4)
    assert losses[-1] < losses[0]


def test_qlora_base_is_4bit_on_cpu_and_adapters_train(tiny_model_dir, tiny_tokenizer, tmp_path):
    import bitsandbytes as bnb

    quant = quantization_config(
        _tcfg(quantize_base="nf4"), "fp32", str(tiny_model_dir), ModelConfig()
    )
    model = apply_lora(_load(tiny_model_dir, tiny_tokenizer, quant), _tcfg(quantize_base="nf4"))
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, bnb.nn.Linear4bit) and q.base_layer.weight.dtype == torch.uint8
    assert q.base_layer.weight.quant_state.quant_type == "nf4"
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    losses = _train(model, random_batch(len(tiny_tokenizer), n=4, length=24), steps=6)
    assert losses[-1] < losses[0]
    merged = save_merged(model, tmp_path / "merged", str(tiny_model_dir), ModelConfig())
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(merged)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # every adapted Linear is the full-precision base weight plus its trained scale x B @ A
    adapted = [(n, m) for n, m in model.get_base_model().named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * len(LINEARS)
    for name, layer in adapted:
        merged, plain = full.get_submodule(name), base.get_submodule(name)
        assert type(merged) is torch.nn.Linear and merged.weight.dtype == torch.float32
        delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        assert delta.abs().max() > 0, name  # trained: B left its zero start
        expected = plain.weight + layer.scaling["default"] * delta
        torch.testing.assert_close(merged.weight, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_quantize_base_needs_lora_and_pretrained_weights(tiny_model_dir):
    with pytest.raises(ConfigError, match="lora.enabled"):
        quantization_config(
            TechniquesConfig(lora=LoraConfig(quantize_base="nf4")),
            "fp32",
            str(tiny_model_dir),
            ModelConfig(),
        )
    with pytest.raises(ConfigError, match="pretrained weights"):
        quantization_config(_tcfg(quantize_base="int8"), "fp32", "tiny", ModelConfig())
    assert quantization_config(_tcfg(), "fp32", str(tiny_model_dir), ModelConfig()) is None


def test_train_saves_peft_adapter_that_reloads_and_merges_identically(
    tmp_path, tiny_model_dir, tiny_tokenizer, text_file
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from onegpu import train

    cfg = {
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
        "training": {
            "micro_batch_size": 4,
            "max_steps": 4,
            "eval_every": 0,
            "eval_batches": 2,
            "warmup_steps": 0,
            "lr": 1e-2,
        },
        "techniques": {"lora": {"enabled": True, "r": 4, "merge_on_save": True}},
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }
    train(cfg)
    final, merged_dir = tmp_path / "run" / "final", tmp_path / "run" / "final-merged"
    assert (final / "adapter_model.safetensors").is_file() and not (
        final / "model.safetensors"
    ).exists()
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
    batch = random_batch(len(tiny_tokenizer), n=4, length=24)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), batch)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final)
    adapter_logits = _logits(adapter, batch)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert not torch.allclose(
        adapter_logits, base_logits, atol=1e-4
    )  # the adapter learned something
    torch.testing.assert_close(_logits(merged, batch), adapter_logits, rtol=1e-4, atol=1e-4)


def test_build_model_loads_a_4bit_base_under_the_adapters(tmp_path, tiny_model_dir, tiny_tokenizer):
    """The run assembly passes the QLoRA quantization config to from_pretrained."""
    import bitsandbytes as bnb

    from onegpu import hardware
    from onegpu.config import from_dict
    from onegpu.training import assemble

    cfg = from_dict(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"seq_len": 32},
            "techniques": {"lora": {"enabled": True, "r": 4, "quantize_base": "nf4"}},
        }
    )
    model = assemble.assemble(
        cfg,
        hardware.detect(),
        "fp32",
        str(tiny_model_dir),
        tokenizer=tiny_tokenizer,
        optimizer=False,
    ).model
    linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * len(LINEARS) and all(m.weight.dtype == torch.uint8 for m in linears)
    assert model.peft_config["default"].r == 4


def test_missing_peft_raises_unavailable_with_install_hint(monkeypatch, tiny_tokenizer):
    import sys

    from helpers import make_tiny_llama
    from onegpu.errors import UnavailableError

    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(UnavailableError) as err:
        apply_lora(make_tiny_llama(tiny_tokenizer), _tcfg())
    assert "onegpu[peft]" in err.value.hint
