"""Attention choice really changes the model's kernel, keeps its outputs, and padding-free packing
keeps documents apart; auto picks per model what the model class supports, and an explicit choice
the model refuses is a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import attention_of
from onegpu.config import ModelConfig, TechniquesConfig
from onegpu.data.batches import Collator
from onegpu.errors import ConfigError
from onegpu.hardware import DeviceInfo
from onegpu.models import load_model
from onegpu.objectives.tokens import model_inputs
from onegpu.techniques import attention as A
from onegpu.training.state import Callback

CPU = DeviceInfo("cpu", "CPU", 8 * 2**30)
H100 = DeviceInfo("cuda", "NVIDIA H100", 80 * 2**30, (9, 0))


def _load(path, tok, attn):
    model = load_model(str(path), ModelConfig(), tok, attn_implementation=attn)
    return model.eval()


def _gemma2_config(tok):
    """Gemma-2: a real family whose class refuses SDPA (its logit soft-capping)."""
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-gemma2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_gemma2_config(tiny_tokenizer)).save_pretrained(str(path))
    tiny_tokenizer.save_pretrained(str(path))
    return path


def _kernels(config):
    return A.model_kernels(config)


def test_flash_on_cpu_falls_back_to_sdpa_with_warning(caplog):
    assert A.resolve_attention(TechniquesConfig(attention="flash"), CPU) == "sdpa"
    assert "needs a CUDA GPU" in caplog.text


def test_default_is_auto_and_support_comes_from_the_model_class(tiny_tokenizer):
    from transformers import LlamaConfig

    assert TechniquesConfig().attention == "auto"
    llama, gemma2 = _kernels(LlamaConfig()), _kernels(_gemma2_config(tiny_tokenizer))
    assert (llama.class_name, llama.sdpa, llama.flash) == ("LlamaForCausalLM", True, True)
    assert (gemma2.class_name, gemma2.sdpa, gemma2.flash) == ("Gemma2ForCausalLM", False, True)
    assert gemma2.supported() == ["flash_attention_2", "eager"]


def test_support_of_a_registered_class_and_of_an_unknown_one():
    """A class added with AutoModelForCausalLM.register is read like a built-in one; a config no
    class is known for is assumed to support every kernel (its load then says what it refuses)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PretrainedConfig,
    )

    class NoSdpaConfig(LlamaConfig):
        model_type = "onegpu-test-no-sdpa"

    class NoSdpaForCausalLM(LlamaForCausalLM):
        config_class = NoSdpaConfig
        _supports_sdpa = False

    AutoConfig.register(NoSdpaConfig.model_type, NoSdpaConfig)
    AutoModelForCausalLM.register(NoSdpaConfig, NoSdpaForCausalLM)
    kernels = _kernels(NoSdpaConfig())
    assert (kernels.model_type, kernels.class_name, kernels.sdpa) == (
        "onegpu-test-no-sdpa",
        "NoSdpaForCausalLM",
        False,
    )
    assert A.resolve_attention(TechniquesConfig(), CPU, "fp32", kernels) == "eager"

    class Unknown(PretrainedConfig):
        model_type = "onegpu-test-unknown"

    assert _kernels(Unknown()) == A.ModelKernels("onegpu-test-unknown", "", flash=True, sdpa=True)


def test_auto_is_the_fastest_kernel_model_and_device_support(tiny_tokenizer, monkeypatch, caplog):
    from transformers import LlamaConfig

    llama, gemma2 = _kernels(LlamaConfig()), _kernels(_gemma2_config(tiny_tokenizer))
    auto = TechniquesConfig(attention="auto")
    monkeypatch.setattr(A, "flash_attn_installed", lambda: True)
    assert A.resolve_attention(auto, H100, "bf16", llama) == "flash_attention_2"
    assert A.resolve_attention(auto, H100, "bf16", gemma2) == "flash_attention_2"
    assert (
        A.resolve_attention(auto, H100, "fp32", llama) == "sdpa"
    )  # flash_attn computes in fp16/bf16 only
    assert A.resolve_attention(auto, CPU, "fp32", llama) == "sdpa"
    monkeypatch.setattr(A, "flash_attn_installed", lambda: False)
    # SDPA dispatches to its own flash kernel: auto does not restrict it to ours.
    assert A.resolve_attention(auto, H100, "bf16", llama) == "sdpa"
    assert not caplog.records
    with caplog.at_level(logging.INFO, logger="onegpu"):
        assert A.resolve_attention(auto, H100, "bf16", gemma2) == "eager"
    assert [r.getMessage() for r in caplog.records] == [
        "attention=auto: gemma2 (Gemma2ForCausalLM) does not support sdpa; using eager"
    ]


def test_explicit_kernel_the_model_refuses_is_a_config_error(tiny_tokenizer, monkeypatch):
    gemma2 = _kernels(_gemma2_config(tiny_tokenizer))
    with pytest.raises(
        ConfigError,
        match=r"attention=sdpa is not supported by gemma2 \(Gemma2ForCausalLM\); "
        r"it supports flash_attention_2, eager",
    ) as err:
        A.resolve_attention(TechniquesConfig(attention="sdpa"), CPU, "fp32", gemma2)
    assert "attention=auto" in err.value.hint and "eager here" in err.value.hint
    assert A.resolve_attention(TechniquesConfig(attention="eager"), CPU, "fp32", gemma2) == "eager"
    # flash without the package would be our SDPA kernel, which the model refuses too.
    monkeypatch.setattr(A, "flash_attn_installed", lambda: False)
    with pytest.raises(ConfigError, match="attention=flash is not supported") as err:
        A.resolve_attention(TechniquesConfig(attention="flash"), H100, "bf16", gemma2)
    assert "install flash-attn" in err.value.hint
    assert A.resolve_attention(TechniquesConfig(attention="flash"), CPU, "fp32", gemma2) == "eager"


def _run_cfg(model_dir, text_file, tmp_path, **techniques):
    return {
        "model": {"name": str(model_dir)},
        "data": {"path": str(text_file), "seq_len": 32, "num_proc": 1},
        "training": {"micro_batch_size": 2, "max_steps": 2, "eval_every": 0, "eval_batches": 1},
        "techniques": techniques,
        "output": {"dir": str(tmp_path), "name": "run", "report_to": "none"},
    }


class _Attention(Callback):
    def on_train_begin(self, run, state):
        self.used = attention_of(run.model)


def test_model_without_sdpa_trains_with_the_default(gemma2_dir, text_file, tmp_path, caplog):
    from onegpu import train

    seen = _Attention()
    with caplog.at_level(logging.INFO, logger="onegpu"):
        assert train(_run_cfg(gemma2_dir, text_file, tmp_path), callbacks=[seen]).state.step == 2
    assert seen.used == "eager"
    assert [r.getMessage() for r in caplog.records if "attention" in r.getMessage()] == [
        "attention=auto: gemma2 (Gemma2ForCausalLM) does not support sdpa; using eager"
    ]
    with pytest.raises(ConfigError, match="attention=sdpa is not supported by gemma2"):
        train(_run_cfg(gemma2_dir, text_file, tmp_path / "explicit", attention="sdpa"))


def test_llama_under_auto_loads_with_sdpa(tiny_model_dir, text_file, tmp_path, caplog):
    from onegpu import train

    seen = _Attention()
    with caplog.at_level(logging.INFO, logger="onegpu.techniques.attention"):
        train(_run_cfg(tiny_model_dir, text_file, tmp_path), callbacks=[seen])
    fallbacks = [r for r in caplog.records if r.name == "onegpu.techniques.attention"]
    assert seen.used == "sdpa" and not fallbacks  # nothing to fall back from


def test_presets_resolve_without_loading_weights():
    from onegpu.config import Config
    from onegpu.models import model_config
    from onegpu.techniques.prepare import load_kwargs

    assert _kernels(model_config("tiny")).class_name == "LlamaForCausalLM"
    assert load_kwargs(Config(), CPU, "fp32", "tiny")["attn_implementation"] == "sdpa"


def test_planner_measures_with_the_kernel_training_resolves(
    tiny_tokenizer, tiny_model_dir, gemma2_dir, monkeypatch, tmp_path
):
    """make_plan measures activations with the kernel a training run would use: Gemma-2 (which
    refuses SDPA) runs its eager attention and never SDPA; Llama runs SDPA."""
    from transformers import LlamaConfig
    from transformers.models.gemma2 import modeling_gemma2

    from onegpu.config import Config
    from onegpu.plan import make_plan

    # nothing measured before: the planner measures now
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    calls = {"sdpa": 0, "eager": 0}
    real_sdpa, real_eager = (
        torch.nn.functional.scaled_dot_product_attention,
        modeling_gemma2.eager_attention_forward,
    )

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def eager(*args, **kwargs):
        calls["eager"] += 1
        return real_eager(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", eager)
    make_plan(Config(), model=str(gemma2_dir), gpu="A100")
    assert calls["eager"] > 0 and calls["sdpa"] == 0, calls
    calls.update(sdpa=0, eager=0)
    make_plan(Config(), model=str(tiny_model_dir), gpu="A100")
    assert calls["sdpa"] > 0, calls

    gemma2 = _gemma2_config(tiny_tokenizer)
    for choice in ("auto", "flash"):
        tcfg = TechniquesConfig(attention=choice)
        assert (
            A.planning_attention(tcfg, LlamaConfig()) == "sdpa"
            and A.planning_attention(tcfg, gemma2) == "eager"
        )
    assert A.planning_attention(TechniquesConfig(attention="eager"), LlamaConfig()) == "eager"
    with pytest.raises(ConfigError, match="not supported by gemma2"):
        A.planning_attention(TechniquesConfig(attention="sdpa"), gemma2)


def test_make_plan_resolves_attention_for_the_model(monkeypatch, gemma2_dir):
    import onegpu.plan.search as search
    from onegpu.config import Config
    from onegpu.plan import make_plan

    seen = []
    monkeypatch.setattr(
        search,
        "search",
        lambda *args, **_: seen.append(args[-1]) or type("P", (), {"best": None})(),
    )
    make_plan(Config(), model=str(gemma2_dir), gpu="A100")
    assert seen == ["eager"]


def test_flash_on_cuda_picks_package_or_sdpa_flash_kernel(monkeypatch):
    flash = TechniquesConfig(attention="flash")
    monkeypatch.setattr(A, "flash_attn_installed", lambda: False)
    assert A.resolve_attention(flash, H100) == A.SDPA_FLASH
    monkeypatch.setattr(A, "flash_attn_installed", lambda: True)
    assert A.resolve_attention(flash, H100) == "flash_attention_2"
    assert A.resolve_attention(TechniquesConfig(attention="eager"), H100) == "eager"
    assert A.resolve_attention(TechniquesConfig(attention="auto"), CPU) == "sdpa"


def test_implementations_switch_and_agree(tiny_model_dir, tiny_tokenizer, monkeypatch):
    A.register_sdpa_flash()
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(torch.backends.cuda.math_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = {}
    for attn in ("eager", "sdpa", A.SDPA_FLASH):
        calls.clear()
        model = _load(tiny_model_dir, tiny_tokenizer, attn)
        assert attention_of(model) == attn
        with torch.no_grad():
            logits[attn] = model(input_ids=ids).logits
        n_layers = model.config.num_hidden_layers
        # eager never calls SDPA; plain SDPA may use any kernel; ours forbids the math fallback.
        assert (
            calls
            == {"eager": [], "sdpa": [True] * n_layers, A.SDPA_FLASH: [False] * n_layers}[attn]
        )
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=1e-5)
    assert torch.allclose(logits["sdpa"], logits[A.SDPA_FLASH], atol=1e-5)


def _doc(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_documents_do_not_see_each_other(tiny_model_dir, tiny_tokenizer, attn):
    model = _load(tiny_model_dir, tiny_tokenizer, attn)
    first = _doc(tiny_tokenizer, "def add(a, b):\n    return a + b\n")
    second = _doc(tiny_tokenizer, "for i in range(10):\n    print(i)\n")
    packed = {
        "input_ids": first + second,
        "labels": first + second,
        "position_ids": list(range(len(first))) + list(range(len(second))),
    }
    collate = Collator(tiny_tokenizer.pad_token_id, multiple=8, position_ids=True)
    batch = collate([packed])
    assert "attention_mask" not in model_inputs(
        batch
    )  # the document boundaries come from position_ids
    with torch.no_grad():
        together = model(**model_inputs(batch)).logits[0, len(first) : len(first) + len(second)]
        alone = model(input_ids=torch.tensor([second])).logits[0]
        # Without position_ids the second document attends to the first: the logits change.
        crossed = model(input_ids=batch["input_ids"]).logits[
            0, len(first) : len(first) + len(second)
        ]
    assert torch.allclose(together, alone, atol=1e-5)
    assert not torch.allclose(crossed, alone, atol=1e-3)


def test_padding_free_batch_has_the_same_loss_without_padding(tiny_model_dir, tiny_tokenizer):
    """Prompt/completion examples packed into one row: same summed loss and target count as the
    padded batch, fewer positions computed."""
    from helpers import count_targets
    from onegpu.objectives.sft import loss_sum
    from onegpu.objectives.tokens import IGNORE

    model = _load(tiny_model_dir, tiny_tokenizer, "sdpa")
    examples = []
    for prompt, completion in [
        ("def add(a, b):", " return a + b"),
        ("x =", " 1"),
        ("for i in", " range(3): pass"),
    ]:
        p, c = _doc(tiny_tokenizer, prompt)[:-1], _doc(tiny_tokenizer, completion)
        examples.append({"input_ids": p + c, "labels": [IGNORE] * len(p) + c})
    padded = Collator(tiny_tokenizer.pad_token_id, multiple=8)(examples)
    packed = Collator(tiny_tokenizer.pad_token_id, multiple=8, position_ids=True)(examples)
    assert (
        packed["input_ids"].shape[0] == 1
        and packed["input_ids"].numel() < padded["input_ids"].numel()
    )
    assert count_targets(packed["labels"]) == count_targets(padded["labels"])
    assert int(packed["attention_mask"].sum()) == int(padded["attention_mask"].sum())
    with torch.no_grad():
        assert torch.allclose(loss_sum(model, packed), loss_sum(model, padded), rtol=1e-5)
