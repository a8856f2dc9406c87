"""A model and a tokenizer given to the engine are left as they were given: after any number of
decode runs (LoRA adapters mixed by row, MoE experts, eager and compiled) and while they run, the
model's attention and experts implementations, its hooks, PEFT's layer flags and active adapters,
its parameters' requires_grad and its train/eval mode are as before; so is the tokenizer's
padding side, also after transformers' own generate path (hf_generate)."""

from __future__ import annotations

import pytest
import torch

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2"]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _state(model) -> dict:
    """What a decode run could change about ``model``, as plain values."""
    configs = {n: m.config for n, m in model.named_modules() if hasattr(m, "config")}
    lora = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A"):
            lora[name] = (m.disable_adapters, m.merged, tuple(m.active_adapters))
    return {
        "attention": {n: c._attn_implementation for n, c in configs.items()},
        "experts": {n: getattr(c, "_experts_implementation", None) for n, c in configs.items()},
        "hooks": {
            n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        },
        "modules": [(n, type(m).__name__) for n, m in model.named_modules()],
        "lora": lora,
        "grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
    }


def _watch(model, seen: list):
    """The model's state at each forward of its head, read while the engine runs."""
    head = model.get_output_embeddings()
    return head.register_forward_pre_hook(lambda *_: seen.append(_state(model)))


def _lora(tokenizer):
    torch.manual_seed(0)
    base = tiny_family_model("llama", tokenizer)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("other", peft.LoraConfig(r=4, target_modules=["k_proj", "o_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    model.requires_grad_(False)
    return model.eval()


# compiled (aot_eager: the graph inductor would compile, without its build): a compile per bucket
@pytest.mark.parametrize("compile_", ["off", pytest.param("on", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["gqa", "moe", "lora"])
def test_the_model_is_as_it_was_given_during_and_after_decode_runs(kind, compile_, tiny_tokenizer):
    if kind == "lora":
        model = _lora(tiny_tokenizer)
    else:
        model = tiny_family_model("llama" if kind == "gqa" else "mixtral", tiny_tokenizer).eval()
    ids = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]
    before = _state(model)
    seen: list = []
    watch = _watch(model, seen)
    watched = _state(model)  # with the watch's own hook
    config = EngineConfig(max_slots=3, max_len=64, compile=compile_, compile_backend="aot_eager")
    engine = Engine(model, None, config)
    adapters = ["default", "__base__", "other"] if kind == "lora" else None
    for _ in range(2):  # runs of several steps each, and again after the first
        engine.generate(ids, GREEDY, adapters=adapters)
        engine.generate(ids[:1], GREEDY)
    watch.remove()
    # PEFT's own routing of a prompt by name (adapter_names) hooks its layers for that forward
    keys = [k for k in watched if not (kind == "lora" and k == "hooks")]
    assert seen and all(s[k] == watched[k] for s in seen for k in keys)
    assert _state(model) == before


def test_generate_batch_leaves_the_callers_tokenizer_as_it_was(tiny_tokenizer):
    """transformers' path pads the prompts on the left for its call only."""
    from onegpu.infer.hf_generate import generate_batch
    from onegpu.infer.sampling_config import SamplingConfig

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]
    side = tiny_tokenizer.padding_side
    tiny_tokenizer.padding_side = "right"
    try:
        out = generate_batch(
            model, tiny_tokenizer, ids, SamplingConfig(max_new_tokens=3, greedy=True), None
        )
        assert tiny_tokenizer.padding_side == "right"
    finally:
        tiny_tokenizer.padding_side = side
    # left padding: each row's new tokens follow its own prompt, as it would alone
    alone = generate_batch(
        model, tiny_tokenizer, ids[:1], SamplingConfig(max_new_tokens=3, greedy=True), None
    )
    assert out[0][0] == alone[0][0]
