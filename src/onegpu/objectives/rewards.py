"""Reward functions for GRPO: built-ins by name, or a user's ``module:function``, with TRL's
signature, so a reward written for TRL's GRPOTrainer runs unchanged:

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

``prompts`` and ``completions`` are text, or chat messages for chat prompts (a completion is then
the one assistant message, in a list); every other column of the records comes by name, one value
per completion. None means "not scored" (TRL's convention): a completion no function scores gets
advantage 0. A function that raises, returns the wrong length or a NaN stops the run with one error
naming it and the prompt. A trained reward model's folder scores as one (reward_model.py).
"""

from __future__ import annotations

import codeop
import importlib
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from onegpu.errors import ConfigError, DataError

NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable
    weight: float


def resolve(gcfg, default_job: bool = False) -> list[Reward]:
    """The configured reward functions, imported now (before any model loads), with weights."""
    names = list(gcfg.rewards) or (["python_continues"] if default_job else [])
    if not names:
        raise ConfigError(
            "training.objective=grpo needs reward functions: grpo.rewards is empty.",
            hint="e.g. --grpo.rewards '[exact_match, format]' or a module:function of your own",
        )
    weights = gcfg.reward_weights or [1.0] * len(names)
    return [Reward(n, _function(n, gcfg), float(w)) for n, w in zip(names, weights, strict=True)]


def _function(name: str, gcfg) -> Callable:
    from onegpu.objectives import reward_model

    if name in BUILTINS:
        return BUILTINS[name](gcfg)
    if reward_model.is_reward_model(name):  # a trained reward model's folder
        return reward_model.reward_model(name)
    if ":" not in name:
        raise ConfigError(
            f"grpo.rewards: '{name}' is neither a built-in reward nor a module:function.",
            hint=f"built-ins: {', '.join(BUILTINS)}; or give e.g. my_rewards:correct",
        )
    module, _, attr = name.partition(":")
    _search_working_directory()
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"grpo.rewards: cannot import '{name}': {exc}.",
            hint="check the module is on PYTHONPATH (or in the working directory) and defines "
            "the function",
        ) from None
    if not callable(fn):
        raise ConfigError(
            f"grpo.rewards: '{name}' is a {type(fn).__name__}, not a function.",
            hint="point it at a function f(prompts, completions, **columns) -> list[float]",
        )
    return fn


def _search_working_directory() -> None:
    """A reward module in the working directory is importable however onegpu was started: the
    `onegpu` console script's sys.path starts at the script's own folder, not at the working
    directory (as ``python -m`` does). Appended last, so a file there never shadows an installed
    package; kept, so the module can import its neighbours when it is called."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def score(
    rewards: list[Reward],
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict[str, list],
    where: Callable[[int], str],
) -> list[list[float]]:
    """Each function's rewards, one list per function (None -> NaN), checked."""
    out = []
    for r in rewards:
        try:
            values = r.fn(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported as one error
            raise DataError(
                f"reward function '{r.name}' raised {type(exc).__name__}: {exc} "
                f"(scoring the completions of {where(0)} onwards).",
                hint="fix the function; it must return one float (or None) per completion",
            ) from exc
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} values"
            raise DataError(
                f"reward function '{r.name}' returned {got} for {len(completions)} completions "
                f"({where(0)} onwards).",
                hint="return a list with one float (or None) per completion",
            )
        row = []
        for i, v in enumerate(values):
            if v is None:
                row.append(math.nan)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise DataError(
                    f"reward function '{r.name}' returned {v!r} for {where(i)}.",
                    hint="return floats (or None for 'not scored')",
                ) from None
            if math.isnan(v) or math.isinf(v):
                raise DataError(
                    f"reward function '{r.name}' returned {v} for {where(i)}.",
                    hint="return a finite float, or None for a completion it cannot score",
                )
            row.append(v)
        out.append(row)
    return out


# ----------------------------------------------------------------------------------- built-ins
def _text(completion) -> str:
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return completion


def _prompt_text(prompt) -> str:
    return _text(prompt) if isinstance(prompt, list) else prompt


def normalise_answer(text: str) -> str:
    """An answer as compared: the content of <answer>...</answer> or \\boxed{...} when present;
    a number (the last in it) without thousands separators, trailing zeros or a final period;
    otherwise lower-cased text with spaces collapsed."""
    text = str(text)
    tagged = re.search(r"<answer>(.*?)</answer>", text, re.S) or re.search(
        r"\\boxed\{([^}]*)\}", text
    )
    if tagged:
        text = tagged.group(1)
    numbers = NUMBER.findall(text)
    if numbers:
        n = numbers[-1].replace(",", "")
        try:
            value = float(n)
        except ValueError:
            return n
        return str(int(value)) if value.is_integer() else repr(value)
    return " ".join(text.strip().lower().rstrip(".").split())


def exact_match(gcfg) -> Callable:
    field = gcfg.answer_field

    def exact_match(completions, **columns):
        if field not in columns:
            raise KeyError(f"no '{field}' column in the data (grpo.answer_field)")
        return [
            float(normalise_answer(_text(c)) == normalise_answer(a))
            for c, a in zip(completions, columns[field], strict=True)
        ]

    return exact_match


def format_check(gcfg) -> Callable:
    pattern = re.compile(gcfg.format_pattern)

    def format(completions, **_):  # noqa: A001 - the name TRL recipes give this reward
        return [float(bool(pattern.fullmatch(_text(c)))) for c in completions]

    return format


def length(gcfg) -> Callable:
    """Completion tokens as a share of grpo.max_completion_length (weight it negative to prefer
    short completions)."""
    limit = gcfg.max_completion_length

    def length(completion_ids, **_):
        return [len(ids) / limit for ids in completion_ids]

    return length


def _compiles(source: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning of odd escapes in sampled text
        try:
            compile(source, "<completion>", "exec")
            return True
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return False


def python_compiles(gcfg) -> Callable:
    """1 if the completion (the code of its first ```python block, when it has one) compiles."""

    def python_compiles(completions, **_):
        out = []
        for c in completions:
            text = _text(c)
            block = re.search(r"```(?:python|py)?\n(.*?)```", text, re.S)
            out.append(float(_compiles(block.group(1) if block else text)))
        return out

    return python_compiles


def python_continues(gcfg) -> Callable:
    """The default job's reward: the share of the completion's full lines that continue the
    prompt's code into valid Python: the longest run of its lines, from the first, after which the
    source still compiles, or is an unfinished block that could (codeop: incomplete, not wrong),
    over its full lines. 0 for a completion with no full line."""

    def python_continues(prompts, completions, **_):
        return [
            _valid_share(_prompt_text(p), _text(c))
            for p, c in zip(prompts, completions, strict=True)
        ]

    return python_continues


def _valid_share(prompt: str, completion: str) -> float:
    lines = completion.split("\n")[:-1]  # the text after the last newline is an unfinished line
    if not lines:
        return 0.0
    valid = 0
    for k in range(1, len(lines) + 1):
        if not _valid_so_far(prompt + "\n".join(lines[:k]) + "\n"):
            break
        valid = k
    return valid / len(lines)


def _valid_so_far(source: str) -> bool:
    if _compiles(source):
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return codeop.compile_command(source, "<completion>", "exec") is None
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
            return False


def calculator_answer(gcfg) -> Callable:
    """The built-in tool-use example's reward (calculator.py): 1 when the conversation's last
    assistant message answers the ``answer`` column's value (normalised as exact_match does),
    else 0: a tool's result alone, or a final call, is not an answer."""
    field = gcfg.answer_field

    def calculator_answer(completions, **columns):
        if field not in columns:
            raise KeyError(f"no '{field}' column in the data (grpo.answer_field)")
        out = []
        for conversation, answer in zip(completions, columns[field], strict=True):
            said = [m for m in conversation if m.get("role") == "assistant"]
            final = said[-1] if said else {}
            right = normalise_answer(final.get("content", "")) == normalise_answer(answer)
            out.append(float(right and not final.get("tool_calls")))
        return out

    return calculator_answer


def calculator_steps(gcfg) -> Callable:
    """A partial-credit reward for the tool-use example: a third for each step of using the tool
    reached, in order: a calculator call made; the calculator answering it (a well-formed call,
    not an error); the last assistant message the right value (calculator_answer's 1). A policy
    that calls but does not yet copy the result still sees its calls pay."""
    answer = calculator_answer(gcfg)

    def calculator_steps(completions, **columns):
        right = answer(completions, **columns)
        out = []
        for conversation, ok in zip(completions, right, strict=True):
            called = any(
                (c.get("function") or {}).get("name") == "calculator"
                for m in conversation
                if m.get("role") == "assistant"
                for c in m.get("tool_calls") or ()
            )
            answered = any(
                m.get("role") == "tool"
                and m.get("name") == "calculator"
                and not str(m.get("content", "")).startswith("error:")
                for m in conversation
            )
            out.append((called + (called and answered) + ok) / 3)
        return out

    return calculator_steps


BUILTINS: dict[str, Callable] = {
    "exact_match": exact_match,
    "format": format_check,
    "length": length,
    "python_compiles": python_compiles,
    "python_continues": python_continues,
    "calculator_answer": calculator_answer,  # the built-in tool-use example's (grpo.tools)
    "calculator_steps": calculator_steps,  # its partial credit: call made, answered, right
}
