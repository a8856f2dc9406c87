"""The built-in tool-use example (grpo.tools calculator): a calculator over digit strings, its
reward, and the questions a run with no data asks.

A question is a sum, difference or product of numbers of two or three digits; the calculator answers
it exactly, and the reward (rewards.calculator_answer) pays 1 for a final answer equal to the
true value.
A tiny model cannot do such arithmetic in its head, so the reward can rise only as far as the policy
learns to call the tool and copy its result (training/tool_default.py warms it up on dialogues
in which it answers half of the questions with a guess instead).
"""

from __future__ import annotations

import json
import random
import re

EXPRESSION = re.compile(r"\s*(\d{1,12})\s*([-+*])\s*(\d{1,12})\s*")
SYSTEM = 'Tools: calculator(expression). Call: <tool_call>{"name": "calculator", ...}</tool_call>'


def calculator(expression: str) -> str:
    """Evaluate a sum, difference or product of two whole numbers.

    Args:
        expression: a+b, a-b or a*b, each number in digits, e.g. 123+45
    """
    m = EXPRESSION.fullmatch(str(expression))
    if m is None:
        raise ValueError(f"not a+b, a-b or a*b of whole numbers: {expression!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def question(rng: random.Random) -> tuple[str, str]:
    """(an expression of two numbers of 2 or 3 digits, or one and a digit for a product, its
    value)."""
    op = rng.choice("+-*")
    a, b = (rng.randint(10, 999) for _ in range(2))
    if op == "*":
        b = rng.randint(2, 9)
    expression = f"{a}{op}{b}"
    return expression, calculator(expression)


def prompt(expression: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": expression}]


def call_text(expression: str) -> str:
    """The call in the hermes format (serve/tools.py reads it)."""
    args = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(args)}</tool_call>"


def guess(expression: str, rng: random.Random) -> str:
    """An answer without the tool: the true value with its last two digits made up."""
    value = int(calculator(expression))
    return str(value - value % 100 + rng.randint(0, 99)) if abs(value) >= 100 else str(value)


def warmup_dialogue(rng: random.Random, call_share: float) -> dict:
    """A chat record of the warm-up: the tool called and its result copied, or (1 - call_share
    of them) a guess."""
    expression, value = question(rng)
    messages = prompt(expression)
    if rng.random() < call_share:
        messages += [
            {"role": "assistant", "content": call_text(expression)},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
    else:
        messages.append({"role": "assistant", "content": guess(expression, rng)})
    return {"messages": messages}


def prompt_record(rng: random.Random) -> dict:
    expression, value = question(rng)
    return {"prompt": prompt(expression), "answer": value}
