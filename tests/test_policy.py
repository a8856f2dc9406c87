"""The engine's per-device policy table (infer/policy.py): every row a switch of the engine that
EngineConfig.policy_off turns off, each naming the committed results file that measured it and,
on a CPU, the two model shapes it was measured on; an unknown row is one clear error."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from families import tiny_family_model
from onegpu.errors import ConfigError
from onegpu.infer import cpu_attention, gqa_attention, policy
from onegpu.infer.engine import Engine, EngineConfig

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_is_a_switch_with_its_results_file_and_shapes():
    assert set(policy.RULES) == {f.name for f in fields(policy.Policy)}
    for name, rule in policy.RULES.items():
        assert (ROOT / rule.results).is_file(), (name, rule.results)
        if rule.device in ("cpu", "any"):
            assert {"tiny", "125m"} <= set(rule.shapes), name
    cpu = policy.Policy.for_device("cpu")
    assert all(getattr(cpu, n) == (r.device in ("cpu", "any")) for n, r in policy.RULES.items())
    assert not policy.Policy.for_device("cpu", ["eager_window"]).eager_window
    with pytest.raises(ConfigError, match="unknown rows"):
        policy.Policy.for_device("cpu", ["no_such_row"])


def test_policy_off_reaches_the_engines_step(tiny_tokenizer):
    """A compiled CPU engine attends in inductor's loops; with that row off it keeps
    transformers' path (the GQA function)."""
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
    assert step.attention == gqa_attention.NAME
