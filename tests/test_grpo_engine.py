"""GRPO's rollouts through the decode engine: each prompt prefilled once for its group, the live
training weights (LoRA adapters included) read with no copy, the default sampler."""

from __future__ import annotations

import pytest
import torch

from families import tiny_family_model
from onegpu.config.grpo import GRPOConfig
from onegpu.objectives.rollout import engine_rollouts


def _greedy(model, ids, new):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_engine_is_the_default_sampler(tiny_tokenizer):
    """A GRPO run's sampling with the default settings goes through the decode engine: each
    distinct prompt prefilled alone, once for its group (generate prefills the padded chunk)."""
    from onegpu.objectives.rollout import sample

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    prefills = []
    model.register_forward_pre_hook(
        lambda m, a, kw: (
            prefills.append(kw["input_ids"].shape) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    prompts = [tiny_tokenizer(p)["input_ids"] for p in ("def f(x):", "class A:")]
    chunk = [p for p in prompts for _ in range(4)]
    gcfg = GRPOConfig(max_completion_length=4)
    out = sample(model, chunk, gcfg, tiny_tokenizer, torch.device("cpu"), rows=8)
    assert len(out.completion_ids) == 8
    assert sorted(prefills) == sorted(torch.Size([1, len(p)]) for p in prompts)


def test_each_prompt_is_prefilled_once_for_its_group(tiny_tokenizer):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    prefills = []
    model.register_forward_pre_hook(
        lambda m, a, kw: (
            prefills.append(kw["input_ids"].shape) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    prompts = [tiny_tokenizer(p)["input_ids"] for p in ("def f(x):", "class A:")]
    chunk = [p for p in prompts for _ in range(4)]  # a group of 4 completions per prompt
    gcfg = GRPOConfig(max_completion_length=8, temperature=1.0)
    out = engine_rollouts(model, chunk, gcfg, [tiny_tokenizer.eos_token_id])
    assert len(prefills) == 2 and len(out) == 8
    # the copied KV serves the group as a prefill would: sampled rows differ, greedy rows agree
    assert len({tuple(r) for r in out[:4]}) > 1
    greedy = engine_rollouts(
        model, chunk, GRPOConfig(max_completion_length=8, temperature=0.0), [-1]
    )
    assert all(r == _greedy(model, prompts[i // 4], 8) for i, r in enumerate(greedy))


def test_rollouts_read_the_live_lora_weights(tiny_tokenizer):
    peft = pytest.importorskip("peft")
    base = tiny_family_model("llama", tiny_tokenizer)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.eval()
    prompt = tiny_tokenizer("def f(x):")["input_ids"]
    gcfg = GRPOConfig(max_completion_length=10, temperature=0.0)
    before = engine_rollouts(model, [prompt], gcfg, [-1])[0]
    with torch.no_grad():  # an optimizer step on the adapters, in place
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    after = engine_rollouts(model, [prompt], gcfg, [-1])[0]
    assert after != before and after == _greedy(model, prompt, 10)


@pytest.mark.slow
def test_a_compiled_run_compiles_its_rollouts_once_with_the_eager_tokens(tiny_tokenizer):
    from torch._dynamo.utils import counters

    from onegpu.objectives import rollout

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    chunk = [tiny_tokenizer("def f(x):")["input_ids"]] * 2
    body = "".join(f"    x{i} = x + {i}\n" for i in range(8))
    longer = [tiny_tokenizer(f"def f(x):\n{body}    return")["input_ids"]] * 2
    assert len(longer[0]) > len(chunk[0]) and len(longer[0]) + 8 > 64  # past the first 64
    gcfg = GRPOConfig(max_completion_length=8, temperature=0.0)
    eager = engine_rollouts(model, chunk, gcfg, [-1])
    eager_longer = engine_rollouts(model, longer, gcfg, [-1])
    counters.clear()
    first = engine_rollouts(model, chunk, gcfg, [-1], compiled=True, max_prompt=len(longer[0]))
    engine, _ = rollout._ENGINES[model]
    graphs = counters["stats"]["unique_graphs"]
    assert engine.stepper.compiled is not None and graphs >= 1
    again = engine_rollouts(model, chunk, gcfg, [-1], compiled=True, max_prompt=len(longer[0]))
    # a longer prompt, within the run's longest: the same engine, its step not compiled again
    long_out = engine_rollouts(model, longer, gcfg, [-1], compiled=True, max_prompt=len(longer[0]))
    assert rollout._ENGINES[model][0] is engine
    assert counters["stats"]["unique_graphs"] == graphs
    assert first == again == eager and long_out == eager_longer
