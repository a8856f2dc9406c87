"""Batched LoRA (infer/batched_lora.py): a decode run whose rows name different adapters adds each
row's adapter from stacked weights by index, not through PEFT's per-row hooks, so the step stays
compiled. Each request's greedy tokens are the ones PEFT's own routing gives it alone; PEFT's LoRA
forward does not run in those decode steps; a new mix of adapters compiles nothing new; PEFT's
layers are as they were after each run; the policy row off gives PEFT's path back."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from families import tiny_family_model
from onegpu.infer.batched_lora import refusal
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams
from onegpu.infer.sampling import Needs

peft = pytest.importorskip("peft")

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2", "for i in range(10):"]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
OFF = ["batched_lora"]  # the policy row: PEFT routes the rows


def _train_looking(model) -> None:
    """Non-zero B: PEFT starts an adapter as the identity, which would hide a wrong routing."""
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    """Three adapters of different ranks, scalings and targets (one reaches the MLP)."""
    torch.manual_seed(0)
    base = tiny_family_model("llama", tiny_tokenizer)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, cfg, adapter_name="alpha")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model.add_adapter("beta", peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    targets = ["v_proj", "up_proj", "down_proj"]
    model.add_adapter("gamma", peft.LoraConfig(r=8, lora_alpha=8, target_modules=targets))
    _train_looking(model)
    return model.eval()


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


def _alone(model, prompt, adapter) -> list[int]:
    """The reference: the request alone, its adapter routed by PEFT."""
    engine = Engine(model, None, EngineConfig(max_slots=1, max_len=64, policy_off=OFF))
    return engine.generate([prompt], GREEDY, adapters=[adapter])[0].token_ids


def _together(engine, ids, names) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(ids, GREEDY, adapters=names)]


def _by_index(engine, ids, names) -> tuple[list[list[int]], bool, bool]:
    """``_together``'s tokens, and whether every decode step of it, or none, took the rows'
    adapters by index (batched LoRA; engine.stats())."""
    before = engine.stats()
    got = _together(engine, ids, names)
    now = engine.stats()
    steps = now.decode_steps - before.decode_steps
    batched = now.batched_lora_steps - before.batched_lora_steps
    return got, steps > 0 and batched == steps, batched == 0


def _decode_calls(module) -> list:
    """The query lengths of ``module``'s calls (1: a decode step's)."""
    lengths = []
    module.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    return lengths


def test_a_mixed_batch_decodes_each_row_with_its_own_adapter(model, ids):
    names = ["alpha", "__base__", "beta", "gamma"]
    expected = [_alone(model, p, n) for p, n in zip(ids, names, strict=True)]
    assert (
        len({tuple(_alone(model, ids[0], n)) for n in ["alpha", "beta", "gamma", "__base__"]}) == 4
    )
    lora_a = model.base_model.model.model.layers[0].self_attn.v_proj.lora_A["gamma"]
    lengths = _decode_calls(lora_a)
    engine = Engine(model, None, EngineConfig(max_slots=4, max_len=64))
    got, every, _ = _by_index(engine, ids, names)
    assert got == expected and every
    # PEFT's gamma ran in the prompt's forward only: no decode step called it
    assert lengths and 1 not in lengths
    lengths.clear()
    off = Engine(model, None, EngineConfig(max_slots=4, max_len=64, policy_off=OFF))
    got, _, none = _by_index(off, ids, names)
    assert got == expected and none and "batched_lora" not in off.stats().policy_rows
    assert 1 in lengths  # the row off: PEFT's hooks route each decode step


def test_the_compiled_step_decodes_any_mix_without_compiling_again(model, ids):
    names = ["alpha", "__base__", "beta", "gamma"]
    mix = ["gamma", "gamma", "__base__", "alpha"]
    expected = {n: [_alone(model, p, n) for p in ids] for n in {*names, *mix}}
    config = EngineConfig(max_slots=4, max_len=64, compile="on", compile_backend="aot_eager")
    engine = Engine(model, None, config)
    counters.clear()
    got, every, _ = _by_index(engine, ids, names)
    assert got == [expected[n][i] for i, n in enumerate(names)]
    stats, graphs = engine.stats(), counters["stats"]["unique_graphs"]
    compiled = stats.compiles
    # the compiled step ran with adapters
    assert compiled >= 1 and stats.compiled_shapes and every
    assert _together(engine, ids, mix) == [expected[n][i] for i, n in enumerate(mix)]
    assert engine.stats().compiles == compiled
    assert counters["stats"]["unique_graphs"] == graphs
    # two rows, fewer than the adapters: a bucket of its own, each row's weights gathered
    assert _together(engine, ids[:2], mix[:2]) == [expected["gamma"][0], expected["gamma"][1]]
    assert engine.stats().compiles == compiled + 1


def test_peft_layers_are_as_they_were_after_a_run(model, ids):
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    model.requires_grad_(False)  # as a server loads them; PEFT's enable_adapters would set some
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    x = torch.tensor([ids[0]])
    with torch.no_grad():
        before = model(input_ids=x).logits
    engine = Engine(model, None, EngineConfig(max_slots=2, max_len=64))
    names = ["beta", "alpha"]  # fewer rows than adapters: each row's A and B gathered
    expected = [_alone(model, p, n) for p, n in zip(ids[:2], names, strict=True)]
    got, every, _ = _by_index(engine, ids[:2], names)
    assert got == expected and every
    assert not layer.disable_adapters and layer.active_adapters == ["alpha"]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    with torch.no_grad():  # the active adapter applies again outside the decode steps
        assert torch.equal(model(input_ids=x).logits, before)


def test_new_weights_and_an_adapter_loaded_later_are_stacked_too(tiny_tokenizer, ids):
    base = tiny_family_model("llama", tiny_tokenizer)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, cfg, adapter_name="first")
    _train_looking(model)
    engine = Engine(model.eval(), None, EngineConfig(max_slots=2, max_len=64))
    engine.generate(ids[:2], GREEDY, adapters=["first", "__base__"])
    _train_looking(model)  # as a training step would: the stacks copy the new weights
    engine.reset_prefix_cache()
    names = ["first", "__base__"]
    expected = [_alone(model, p, n) for p, n in zip(ids[:2], names, strict=True)]
    assert _together(engine, ids[:2], names) == expected
    model.add_adapter("later", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    _train_looking(model)
    model.eval()
    engine.reset_prefix_cache()  # the weights changed: "first"'s B too
    names = ["later", "first"]
    expected = [_alone(model, p, n) for p, n in zip(ids[:2], names, strict=True)]
    got, every, _ = _by_index(engine, ids[:2], names)
    assert got == expected and every


def test_a_dora_adapter_is_left_to_peft(tiny_tokenizer, ids):
    base = tiny_family_model("llama", tiny_tokenizer)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    model = peft.get_peft_model(base, cfg, adapter_name="dora")
    _train_looking(model)
    model.eval()
    assert "DoRA" in refusal(model)
    engine = Engine(model, None, EngineConfig(max_slots=2, max_len=64))
    got, _, none = _by_index(engine, ids[:2], ["dora", "__base__"])
    assert got == [_alone(model, ids[0], "dora"), _alone(model, ids[1], "__base__")] and none


def test_a_warm_up_compiles_the_steps_that_serve_adapters(model, ids):
    """A server warms up before any request names an adapter; its requests then all do."""
    config = EngineConfig(max_slots=2, max_len=64, compile="on", compile_backend="aot_eager")
    engine = Engine(model, None, config)
    assert engine.warmup((Needs(),)) == len(engine.buckets())
    names = ["gamma", "__base__"]
    expected = [_alone(model, p, n) for p, n in zip(ids[:2], names, strict=True)]
    assert _together(engine, ids[:2], names) == expected
    assert engine.stats().compiles == 0
