"""GRPO's bad inputs (docs/guarantees.md, bad-input catalogue): each through `onegpu train` as a
user runs it, with the catalogue's checks (one error naming the field and the fix, exit code 2, no
run directory), and the reward functions' failures mid-run (one error naming the function and the
prompt)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from onegpu.cli.main import main
from test_bad_inputs import Case, base_args, check_case

pytestmark = pytest.mark.usefixtures("one_thread")

REWARDS = """
import math
VALUE = 3
def short(completions, **kw):
    return [1.0 - len(c) / 100 for c in completions]
def raises(prompts, completions, **kw):
    raise ValueError("no score for you")
def too_few(completions, **kw):
    return [1.0]
def nan_at_third(completions, **kw):
    return [math.nan if i == 2 else 0.5 for i in range(len(completions))]
"""


def write_prompts(tmp: Path, n: int = 16, columns=("prompt", "answer")) -> Path:
    path = tmp / "prompts.jsonl"
    rows = [
        {k: (f"What is {i} plus {i}? " if k == "prompt" else str(2 * i)) for k in columns}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def grpo_args(tmp, model_dir, columns=("prompt", "answer"), rewards="[exact_match]") -> list:
    args = base_args(tmp, model_dir)
    args[args.index("--data.path") + 1] = str(write_prompts(tmp, columns=columns))
    return args + [
        "--training.objective", "grpo",
        "--training.micro_batch_size", "4",
        "--grpo.group_size", "4",
        "--grpo.max_completion_length", "8",
        "--grpo.rewards", rewards,
    ]  # fmt: skip


def _reward_module(monkeypatch, tmp):
    (tmp / "my_rewards.py").write_text(textwrap.dedent(REWARDS), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp))


CASES = [
    Case(
        "grpo-group-size-one",
        ["--grpo.group_size", "1"],
        ("grpo.group_size must be >= 2", "set grpo.group_size to e.g. 8"),
    ),
    Case(
        "grpo-group-split-between-steps",
        ["--grpo.group_size", "3"],
        ("4 completions per step is not a multiple of grpo.group_size=3",),
    ),
    Case(
        "grpo-reward-not-callable",
        ["--grpo.rewards", "[my_rewards:VALUE]"],
        ("grpo.rewards: 'my_rewards:VALUE' is a int, not a function", "point it at a function"),
        _reward_module,
    ),
    Case(
        "grpo-reward-not-importable",
        ["--grpo.rewards", "[no_such_module_here:score]"],
        ("grpo.rewards: cannot import 'no_such_module_here:score'", "PYTHONPATH"),
    ),
    Case(
        "grpo-reward-unknown-name",
        ["--grpo.rewards", "[exact]"],
        ("'exact' is neither a built-in reward nor a module:function", "built-ins: exact_match"),
    ),
    Case(
        "grpo-rewards-empty",
        ["--grpo.rewards", "[]"],
        ("grpo.rewards is empty",),
    ),
    Case(
        "grpo-missing-prompt-column",
        lambda tmp, md: [
            "--data.path",
            str(write_prompts(tmp, columns=("question", "answer"))),
        ],  # fmt: skip
        ("training.objective=grpo needs a 'prompt' column", "set data.prompt_field"),
    ),
    Case(
        "grpo-reference-impossible",
        ["--grpo.beta", "0.04", "--grpo.reference", "adapters"],
        ("grpo.reference=adapters needs LoRA", "set grpo.reference=copy"),
    ),
    Case(
        "grpo-completion-beyond-positions",
        ["--grpo.max_completion_length", "240"],
        (
            "data.seq_len=32 (the longest prompt) + grpo.max_completion_length=240 = 272 exceeds "
            "the model's max_position_embeddings=256",
        ),
    ),
    Case(
        "grpo-with-dpo-field",
        ["--preference.beta", "0.2"],
        ("preference.beta is a setting of the preference objectives", "grpo.beta"),
    ),
    Case(
        "grpo-reward-weights-count",
        ["--grpo.reward_weights", "[1.0, 0.5]"],
        ("grpo.reward_weights has 2 weights for 1 reward functions",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_grpo_bad_input(case, tmp_path, tiny_model_dir, capsys, monkeypatch):
    check_case(case, grpo_args(tmp_path, tiny_model_dir), tmp_path, tiny_model_dir, capsys,
               monkeypatch)  # fmt: skip


def test_grpo_field_set_for_sft_is_refused(tmp_path, tiny_model_dir, capsys):
    code = main(base_args(tmp_path, tiny_model_dir) + ["--grpo.beta", "0.1"])
    err = capsys.readouterr().err
    assert code == 2 and "grpo.beta is set, but training.objective=sft" in err


@pytest.mark.parametrize(
    "reward, expect",
    [
        ("my_rewards:raises", "reward function 'my_rewards:raises' raised ValueError: no score"),
        ("my_rewards:too_few", "reward function 'my_rewards:too_few' returned 1 values for 4"),
        (
            "my_rewards:nan_at_third",
            "reward function 'my_rewards:nan_at_third' returned nan for prompt",
        ),
    ],
)
def test_failing_reward_stops_the_run_naming_function_and_prompt(
    reward, expect, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    _reward_module(monkeypatch, tmp_path)
    code = main(grpo_args(tmp_path, tiny_model_dir, rewards=f"[{reward}]"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert expect in err and err.count("error: ") == 1, err
    assert "prompt" in err.split(expect[:20])[1]


def test_grpo_cases_are_in_the_catalogue():
    doc = (Path(__file__).parents[1] / "docs" / "guarantees.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"add these cases to docs/guarantees.md: {missing}"


def test_a_run_that_fails_before_its_first_step_leaves_no_run_directory(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """A reward that raises at the step-0 evaluation: the run directory it had created (config,
    empty metrics, tracker files) is removed, not left as if a run had trained there."""
    _reward_module(monkeypatch, tmp_path)
    assert main(grpo_args(tmp_path, tiny_model_dir, rewards="[my_rewards:raises]")) == 2
    assert "raised ValueError" in capsys.readouterr().err
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_a_run_that_fails_after_a_step_keeps_its_directory(tmp_path, tiny_model_dir):
    """What a run that trained wrote stays for diagnosis (its metrics) and, with checkpoints, for
    a resume."""
    import onegpu
    from helpers import make_cfg
    from onegpu.training.state import Callback

    class FailAtStep2(Callback):
        def on_step_end(self, run, state) -> None:
            if state.step == 2:
                raise RuntimeError("stop here")

    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=3, save_every=0, eval_every=0)
    with pytest.raises(RuntimeError, match="stop here"):
        onegpu.train(cfg, callbacks=[FailAtStep2()])
    (run,) = (tmp_path / "runs").iterdir()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert (run / "config.yaml").is_file() and any('"train"' in x for x in lines)
