"""The engine's per-device policy table (infer/policy.py): every row a switch of the engine that
EngineConfig.policy_off turns off, each naming the committed results file that measured it and,
on a CPU, the two model shapes it was measured on; an unknown row is one clear error. The off
switch reaches the engine from `onegpu generate` and `onegpu serve`'s configs; doctor prints the
rows."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from families import tiny_family_model
from onegpu.errors import ConfigError
from onegpu.infer import cpu_attention, policy
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_is_a_switch_with_its_results_file_and_shapes():
    assert set(policy.RULES) == {f.name for f in fields(policy.Policy)}
    for name, rule in policy.RULES.items():
        assert (ROOT / rule.results).is_file(), (name, rule.results)
        if rule.device in ("cpu", "any"):  # the GPU rows wait for a card's second shape
            assert len(set(rule.shapes)) >= 2, name
        assert rule.why, name
    cpu = policy.Policy.for_device("cpu")
    assert all(getattr(cpu, n) == (r.device in ("cpu", "any")) for n, r in policy.RULES.items())
    assert not policy.Policy.for_device("cpu", ["eager_window"]).eager_window
    with pytest.raises(ConfigError, match="unknown rows"):
        policy.Policy.for_device("cpu", ["no_such_row"])


def test_policy_off_reaches_the_engines_step(tiny_tokenizer):
    """A compiled CPU engine attends in inductor's loops; with that row off it keeps
    transformers' SDPA function."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    on = Engine(model, None, EngineConfig(max_slots=2, max_len=64, compile="on"))
    assert on.decode_step.attention == cpu_attention.NAME
    off = EngineConfig(
        max_slots=2,
        max_len=64,
        compile="on",
        policy_off=["cpu_attention_loops"],
    )
    step = Engine(model, None, off).decode_step
    assert step.attention == "sdpa"  # transformers' (a CPU applies no gqa_decode row)


def test_the_cpu_token_budget_row_and_its_off_switch(tiny_tokenizer):
    """On a CPU a step computes 256 tokens at most (the row); off, a whole max_len prompt."""
    model = tiny_family_model("llama", tiny_tokenizer, max_position_embeddings=1024).eval()
    on = Engine(model, None, EngineConfig(max_slots=1, max_len=640))
    off = Engine(
        model, None, EngineConfig(max_slots=1, max_len=640, policy_off=["cpu_token_budget"])
    )
    assert on.scheduler.config.token_budget == policy.CPU_TOKEN_BUDGET
    assert off.scheduler.config.token_budget == 640
    prompt = [3 + i % 300 for i in range(600)]  # three steps under the row, one without it
    for engine, steps in ((on, 3), (off, 1)):
        engine.submit(prompt, SamplingParams(max_new_tokens=1))
        taken = 0
        while engine.has_work():
            engine.step()
            taken += 1
        assert taken == steps


def test_policy_off_reaches_the_engine_from_generate_and_serve(tiny_tokenizer):
    """`onegpu generate --policy_off` (SamplingConfig) and `onegpu serve --policy_off`
    (ServeConfig) switch the rows off in the engine they build (what each row then does
    differently: the tests above and the rows' own tests)."""
    from onegpu.infer.engine_generate import generate_config
    from onegpu.infer.sampling_config import SamplingConfig
    from onegpu.serve.config import ServeConfig
    from onegpu.serve.launch import make_engine

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    scfg = SamplingConfig(max_new_tokens=2, policy_off="eager_window,cpu_token_budget")
    engine = Engine(model, None, generate_config(scfg, [[1, 2, 3]], 2))
    assert not engine.policy.eager_window and not engine.policy.cpu_token_budget
    assert engine.policy.batched_lora  # the rows not named stay on

    small = dict(max_slots=1, max_len=64, kv_memory=0.001)  # 1 MB of KV
    served = make_engine(model, None, ServeConfig(policy_off="cpu_attention_loops", **small))
    assert not served.policy.cpu_attention_loops and served.policy.eager_window
    kv = served.pool_plan  # the pool sized from --kv_memory, by the engine's config
    assert kv.budget_source == "--kv_memory" and kv.budget_bytes == int(0.001 * 2**30)
    assert kv.num_blocks * 16 * kv.bytes_per_position <= kv.budget_bytes
    with pytest.raises(ConfigError, match="unknown rows"):
        make_engine(model, None, ServeConfig(policy_off="no_such_row", **small))


def test_doctor_and_the_summary_say_which_rows_are_on_and_why():
    lines = policy.summary("cpu", ["eager_window"])
    assert any(line.startswith("off eager_window:") for line in lines)
    assert any(line.startswith("on  cpu_token_budget:") for line in lines)
    assert not any("small_gemv" in line for line in lines)  # a GPU row: not this device's
    assert all(policy.RULES[line.split()[1].rstrip(":")].results in line for line in lines)
    assert policy.parse_off(" eager_window, cpu_token_budget,") == [
        "eager_window",
        "cpu_token_budget",
    ]
