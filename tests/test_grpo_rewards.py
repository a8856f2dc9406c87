"""GRPO's built-in rewards and the checks every reward function's output goes through."""

from __future__ import annotations

import json
import math

import pytest

from onegpu.config import GRPOConfig
from onegpu.errors import DataError
from onegpu.objectives.rewards import BUILTINS, Reward, normalise_answer, resolve, score


def builtin(name, **cfg):
    return BUILTINS[name](GRPOConfig(**cfg))


@pytest.mark.parametrize(
    "completion, answer, match",
    [
        ("The answer is 1,000.", "1000", True),
        ("so x = 3.50", "3.5", True),
        ("<think>2+2</think><answer>4</answer>", "4", True),
        ("therefore \\boxed{12}", "12.0", True),
        ("I get 7, then 8", "7", False),  # the last number is the answer
        ("Paris.", " paris", True),
        ("Lyon", "Paris", False),
    ],
)
def test_exact_match_normalises_numbers_and_text(completion, answer, match):
    got = builtin("exact_match")(completions=[completion], answer=[answer])
    assert got == [float(match)]


def test_exact_match_reads_chat_completions_and_names_its_column():
    chat = [{"role": "assistant", "content": "It is 42"}]
    assert builtin("exact_match")(completions=[chat], answer=["42"]) == [1.0]
    assert builtin("exact_match", answer_field="solution")(completions=["42"], solution=["42"]) == [
        1.0
    ]
    with pytest.raises(KeyError, match="'answer' column"):
        builtin("exact_match")(completions=["42"], other=["42"])


def test_format_length_and_python_rewards():
    fmt = builtin("format")
    good = "<think>a</think>\n<answer>b</answer>"
    assert fmt(completions=[good, "b", good + " trailing"]) == [1.0, 0.0, 0.0]
    assert builtin("length", max_completion_length=10)(completion_ids=[[1] * 5, [1] * 10]) == [
        0.5,
        1.0,
    ]
    compiles = builtin("python_compiles")
    assert compiles(completions=["x = 1\n", "def f(:\n", "```python\ny = 2\n```"]) == [1, 0, 1]
    cont = builtin("python_continues")
    prompt = "def f(x):\n    y = x + 1\n"
    # 2 of 2 full lines valid; 1 of 2 (the second breaks it); no full line: 0
    got = cont(
        prompts=[prompt] * 3,
        completions=["    return y\n\nz = 2\n", "    return y\n  )(\n", "    return"],
    )
    assert got == [1.0, 0.5, 0.0]
    # an unfinished block that could still compile counts as valid so far
    assert cont(prompts=[prompt], completions=["    if y:\n"]) == [1.0]


def test_score_turns_none_into_nan_and_refuses_nan_wrong_length_and_raising():
    where = lambda i: f"prompt {i}"  # noqa: E731
    ok = Reward("ok", lambda completions, **_: [None, 0.5], 1.0)
    out = score([ok], ["p", "p"], ["a", "b"], [[1], [2]], {}, where)
    assert math.isnan(out[0][0]) and out[0][1] == 0.5
    cases = [
        (lambda completions, **_: [0.1, math.nan], "returned nan for prompt 1"),
        (lambda completions, **_: [0.1], "returned 1 values for 2 completions"),
        (lambda completions, **_: 1 / 0, "raised ZeroDivisionError"),
        (lambda completions, **_: ["high", 1], "returned 'high' for prompt 0"),
    ]
    for fn, message in cases:
        with pytest.raises(DataError, match=message):
            score([Reward("f", fn, 1.0)], ["p", "p"], ["a", "b"], [[1], [2]], {}, where)


def test_resolve_names_weights_and_the_default_job():
    rewards = resolve(GRPOConfig(rewards=["length", "format"], reward_weights=[2.0, 0.5]))
    assert [(r.name, r.weight) for r in rewards] == [("length", 2.0), ("format", 0.5)]
    assert [r.name for r in resolve(GRPOConfig(), default_job=True)] == ["python_continues"]


def test_normalise_answer_keeps_non_numbers_readable():
    assert normalise_answer("  Hello   World. ") == "hello world"
    assert normalise_answer("-0.50") == "-0.5"


def test_a_reward_module_in_the_working_directory_is_found_by_the_console_script(
    tmp_path, monkeypatch
):
    """`onegpu` as its console script starts sys.path at its own folder, not the working
    directory; the help says the working directory is searched, so it is."""
    import sys

    (tmp_path / "cwd_reward_mod.py").write_text(
        "def fn(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (reward,) = resolve(GRPOConfig(rewards=["cwd_reward_mod:fn"]))
    assert reward.fn(prompts=["p"], completions=["c"]) == [1.0]
    assert sys.path[-1] == str(tmp_path)  # searched last: installed packages are not shadowed


def test_calculator_steps_pays_a_third_for_each_step_of_using_the_tool():
    call = {"role": "assistant", "content": "", "tool_calls": [_calc_call("12+34")]}
    answered = {"role": "tool", "name": "calculator", "content": "46"}
    failed = {"role": "tool", "name": "calculator", "content": "error: 'calculator' raised ..."}
    right, wrong = ({"role": "assistant", "content": v} for v in ("46", "40"))
    convs = [
        [call, answered, right],  # every step: 1
        [call, answered, wrong],  # called, answered, not copied: 2/3
        [call, failed, wrong],  # a call the calculator refused: 1/3
        [wrong],  # no call: 0
        [right],  # right without the tool: the answer's third
        [{"role": "assistant", "content": "", "tool_calls": [_calc_call("1+1", "other")]}],
    ]
    got = builtin("calculator_steps")(completions=convs, answer=["46"] * len(convs))
    assert got == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0, 1 / 3, 0.0])


def _calc_call(expression: str, name: str = "calculator") -> dict:
    arguments = json.dumps({"expression": expression})
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
