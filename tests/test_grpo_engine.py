"""GRPO's rollouts through the decode engine: a group's prompt computed once (the prefix cache),
the live training weights (LoRA adapters included) read with no copy, the default sampler, and a
compiled run's engine kept by the objective, not by a table that outlives it."""

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
    distinct prompt's full blocks computed once for its group, each other completion computing
    only its last block, every forward a row per completion at most (generate would prefill the
    whole padded chunk, 8 rows of the longest prompt)."""
    from onegpu.objectives.rollout import sample

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    prefills = []
    model.register_forward_pre_hook(
        lambda m, a, kw: (
            prefills.append(kw["input_ids"].shape) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    texts = ("def f(x):\n    return x + 1\n" * 3, "class A:\n    pass\n" * 4)
    prompts = [tiny_tokenizer(p)["input_ids"] for p in texts]
    chunk = [p for p in prompts for _ in range(4)]
    gcfg = GRPOConfig(max_completion_length=4)
    out = sample(model, chunk, gcfg, tiny_tokenizer, torch.device("cpu"), rows=8)
    assert len(out.completion_ids) == 8
    tails = [len(p) - (len(p) - 1) // 16 * 16 for p in prompts]
    computed = sum(rows * length for rows, length in prefills)
    assert computed == sum(len(p) + 3 * t for p, t in zip(prompts, tails, strict=True))


def test_a_group_computes_its_prompt_once_and_each_completion_only_its_last_block(tiny_tokenizer):
    """The group's completions share the prompt's full KV blocks through the prefix cache: its
    tokens are computed once, and each other completion computes only the last, partial block
    (the one it goes on writing); the shared KV serves them as a prefill of their own would."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    computed = []
    model.register_forward_pre_hook(
        lambda m, a, kw: (
            computed.append(kw["input_ids"].numel()) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    texts = ("def f(x):\n    return x + 1\n" * 3, "class A:\n    pass\n" * 4)
    prompts = [tiny_tokenizer(p)["input_ids"] for p in texts]
    assert all(len(p) > 16 for p in prompts)  # at least one full block each
    chunk = [p for p in prompts for _ in range(4)]  # a group of 4 completions per prompt
    gcfg = GRPOConfig(max_completion_length=8, temperature=1.0)
    out = engine_rollouts(model, chunk, gcfg, [tiny_tokenizer.eos_token_id])
    tails = [len(p) - (len(p) - 1) // 16 * 16 for p in prompts]
    assert sum(computed) == sum(len(p) + 3 * t for p, t in zip(prompts, tails, strict=True))
    assert len(out) == 8 and len({tuple(r) for r in out[:4]}) > 1  # sampled rows differ
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
    kept, most = rollout.KeptEngine(), len(longer[0])
    first = engine_rollouts(model, chunk, gcfg, [-1], True, max_prompt=most, kept=kept)
    engine = kept.engine
    graphs = counters["stats"]["unique_graphs"]
    assert engine.stats().compiled_shapes and graphs >= 1  # its step compiled and ran
    again = engine_rollouts(model, chunk, gcfg, [-1], True, max_prompt=most, kept=kept)
    # a longer prompt, within the run's longest: the same engine, its step not compiled again
    long_out = engine_rollouts(model, longer, gcfg, [-1], True, max_prompt=most, kept=kept)
    assert kept.engine is engine
    assert counters["stats"]["unique_graphs"] == graphs
    assert first == again == eager and long_out == eager_longer


def test_the_kept_engine_goes_with_the_objective_that_keeps_it(tiny_tokenizer):
    """A kept engine holds the model: kept in a module-level table keyed by the model, the two
    would live as long as the process; kept by the objective, they go when it does."""
    import gc
    import weakref

    from onegpu.objectives import rollout

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    kept = rollout.KeptEngine()
    prompt = [tiny_tokenizer("def f(x):")["input_ids"]]
    gcfg = GRPOConfig(max_completion_length=4, temperature=0.0)
    with torch.compiler.set_stance("force_eager"):  # the kept engine's path, without compiling
        engine_rollouts(model, prompt, gcfg, [-1], compiled=True, max_prompt=8, kept=kept)
    assert kept.engine is not None
    gone = weakref.ref(model)
    del model, kept
    gc.collect()
    assert gone() is None
