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
    assert on.stats().decode_attention == cpu_attention.NAME
    off = EngineConfig(
        max_slots=2,
        max_len=64,
        compile="on",
        policy_off=["cpu_attention_loops"],
    )
    stats = Engine(model, None, off).stats()
    assert stats.decode_attention == "sdpa"  # transformers' (a CPU applies no gqa_decode row)
    assert "cpu_attention_loops" not in stats.policy_rows


def test_the_cpu_token_budget_row_and_its_off_switch(tiny_tokenizer):
    """On a CPU a step computes 256 tokens at most (the row); off, a whole max_len prompt."""
    model = tiny_family_model("llama", tiny_tokenizer, max_position_embeddings=1024).eval()
    on = Engine(model, None, EngineConfig(max_slots=1, max_len=640))
    off = Engine(
        model, None, EngineConfig(max_slots=1, max_len=640, policy_off=["cpu_token_budget"])
    )
    assert "cpu_token_budget" in on.stats().policy_rows
    assert "cpu_token_budget" not in off.stats().policy_rows
    prompt = [3 + i % 300 for i in range(600)]  # three steps under the row, one without it
    for engine, steps in ((on, 3), (off, 1)):
        engine.submit(prompt, SamplingParams(max_new_tokens=1))
        taken = 0
        while engine.has_work():
            engine.step()
            taken += 1
        assert taken == steps


def _engines_of(model, off: str) -> dict:
    """The engine each command builds with ``off`` as its --policy_off (--grpo.policy_off for
    GRPO's sampler), from its parsed config, as each command builds it."""
    from onegpu.bench.infer import BenchInferConfig
    from onegpu.bench.infer import engine_config as bench_config
    from onegpu.config.grpo import GRPOConfig
    from onegpu.infer.engine_generate import generate_config
    from onegpu.infer.sampling_config import SamplingConfig
    from onegpu.objectives.rollout import engine_config as rollout_config
    from onegpu.serve.config import ServeConfig
    from onegpu.serve.launch import make_engine

    small = dict(max_slots=1, max_len=64, kv_memory=0.001)  # 1 MB of KV
    bench = BenchInferConfig(prompt_len=8, new_tokens=4, policy_off=off)
    return {
        "generate": Engine(model, None, generate_config(SamplingConfig(policy_off=off), [[1]], 2)),
        "serve": make_engine(model, None, ServeConfig(policy_off=off, **small)),
        "bench infer": Engine(model, None, bench_config(bench, 2, "off")),
        "grpo": Engine(model, None, rollout_config(GRPOConfig(policy_off=off), 2, 64, [0], False)),
    }


def test_policy_off_reaches_the_engine_of_every_command(tiny_tokenizer):
    """`onegpu generate`, `serve`, `bench infer` and GRPO's sampler each build an engine with the
    rows their --policy_off names off, and the others on (what each row then does differently:
    the tests above and the rows' own tests)."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    every = policy.Policy.for_device("cpu").on()
    assert {"eager_window", "cpu_token_budget", "batched_lora"} <= set(every)
    for command, engine in _engines_of(model, "eager_window,cpu_token_budget").items():
        rows = engine.stats().policy_rows
        assert rows == tuple(r for r in every if r not in ("eager_window", "cpu_token_budget"))
        assert "batched_lora" in rows, command  # the rows not named stay on
    for command, engine in _engines_of(model, "").items():
        assert engine.stats().policy_rows == every, command


def test_an_unknown_row_is_one_error_naming_the_flag_and_the_rows(tiny_tokenizer):
    """Each command's config refuses a row not in the table before any model loads (serve's and
    bench infer's checks, GRPO's objective); the message names the flag and lists the rows."""
    from onegpu.bench.infer import BenchInferConfig, _check
    from onegpu.infer.engine_generate import generate_config
    from onegpu.infer.sampling_config import SamplingConfig
    from onegpu.serve.config import ServeConfig

    checks = {
        "--policy_off": [
            lambda: ServeConfig(policy_off="eager_window,no_such_row").check(),
            lambda: _check(BenchInferConfig(policy_off="no_such_row")),
            lambda: generate_config(SamplingConfig(policy_off="no_such_row"), [[1]], 2),
        ],
        "--grpo.policy_off": [lambda: policy.parse_off("no_such_row", "--grpo.policy_off")],
    }
    for flag, calls in checks.items():
        for call in calls:
            with pytest.raises(ConfigError) as err:
                call()
            text = str(err.value)
            assert flag in text and "no_such_row" in text and "eager_window" not in text[:40]
            assert all(name in text for name in policy.RULES)  # the rows there are


def test_grpo_refuses_an_unknown_row_before_it_trains_and_rows_its_sampler_ignores(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    """GRPO's objective, made before the first step, names an unknown row; rows set for a
    sampler that is not the engine are an error of the config's check."""
    from onegpu.config import GRPOConfig, from_dict, validate
    from onegpu.objectives.grpo import GRPO
    from test_grpo import grpo_cfg

    with pytest.raises(ConfigError, match=r"--grpo\.policy_off: unknown policy rows"):
        GRPO(GRPOConfig(policy_off="no_such_row"), None, [], tiny_tokenizer, "prompt")
    grpo = {"policy_off": "eager_window", "sampler": "generate"}
    cfg = grpo_cfg(tmp_path, tiny_model_dir, grpo=grpo)
    with pytest.raises(ConfigError, match="grpo.sampler=generate samples without the engine"):
        validate(from_dict(cfg))


def test_the_serve_start_up_lines_say_which_rows_are_on_and_why(tiny_tokenizer):
    from onegpu.serve.config import ServeConfig
    from onegpu.serve.launch import make_engine, startup_lines

    model = tiny_family_model("llama", tiny_tokenizer).eval()
    cfg = ServeConfig(policy_off="eager_window", max_slots=1, max_len=64, kv_memory=0.001)
    lines = startup_lines(make_engine(model, None, cfg), cfg)
    rows = [line for line in lines if line.startswith("policy ")]
    assert any(line.startswith("policy off eager_window: ") for line in rows)
    assert any(line.startswith("policy on  cpu_token_budget: ") for line in rows)
    for name, rule in policy.RULES.items():
        if rule.device in ("cpu", "any"):  # each of this device's rows, with why and where
            assert any(f" {name}: {rule.why} ({rule.results};" in line for line in rows), name
    assert not any("small_gemv" in line for line in rows)  # a GPU row: not this device's
    assert lines[-1] == "prefix caching: on"


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
