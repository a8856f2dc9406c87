"""grpo.tools reach the chat template: every prompt and every turn of a rollout is rendered with
the tools' JSON schemas (the chat template's ``tools``, as TRL's GRPOTrainer passes them), and a
tool the template cannot describe is refused before any model loads."""

from __future__ import annotations

import copy
import sys
import textwrap

import datasets
import pytest

from onegpu.config import Config
from onegpu.data import batches
from onegpu.data.tokenizer import CHAT_TEMPLATE
from onegpu.errors import ConfigError
from onegpu.objectives import tools as tools_mod
from onegpu.objectives.multiturn import ToolUse, _result, _said, _tool_turn
from onegpu.training.data import tool_schemas

# the tiny template, with the tools shown first, as chat models' templates show them
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    + CHAT_TEMPLATE
)


@pytest.fixture
def tools_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _grpo(tools):
    cfg = Config()
    cfg.training.objective = "grpo"
    cfg.grpo.tools = tools
    cfg.data.seq_len = 1024  # the schemas' JSON is long in the tests' small vocabulary
    return cfg


def _prompt_texts(tok, cfg) -> list[str]:
    prompts = [[{"role": "user", "content": "12+34"}], [{"role": "user", "content": "5*6"}]]
    ds = datasets.Dataset.from_dict({"prompt": prompts})
    out, _ = batches.tokenize_counted(ds, "prompt", tok, cfg.data, "train", tool_schemas(cfg))
    return [tok.decode(ids) for ids in out["prompt_ids"]]


def test_the_prompts_are_rendered_with_the_tools_schemas(tools_tokenizer):
    with_tools = _prompt_texts(tools_tokenizer, _grpo(["calculator"]))
    without = _prompt_texts(tools_tokenizer, _grpo([]))
    for text, plain in zip(with_tools, without, strict=True):
        assert '"name": "calculator"' in text and '"expression"' in text
        assert "calculator" not in plain
        assert text.endswith(plain)  # the same conversation after the tools' header


def test_each_tool_turn_is_rendered_with_the_tools(tools_tokenizer):
    """The tokens appended after a call are the difference of two renderings that both carry the
    tools: with a template that shows them, the prompt with them plus those tokens is the
    rendering of the whole conversation with them."""
    tok = tools_tokenizer
    schemas = tools_mod.schemas(["calculator"])
    use = ToolUse(None, "hermes", tok, schemas)
    raw = [{"role": "user", "content": "12+34"}]
    prompt = tok.apply_chat_template(raw, tools=schemas, tokenize=False, add_generation_prompt=True)
    said, result = "call", _result("calculator", "46")
    added = _tool_turn(use, [*raw, _said(said)], [result], said, tok.eos_token)
    whole = tok.apply_chat_template(
        [*raw, _said(said), result], tools=schemas, tokenize=False, add_generation_prompt=True
    )
    assert prompt + said + tok.eos_token + tok.decode(added) == whole
    assert '"name": "calculator"' in whole


def test_a_tool_the_template_cannot_describe_is_refused(tmp_path, monkeypatch):
    (tmp_path / "vaguetools.py").write_text(
        textwrap.dedent(
            '''
            def vague(text):
                return text

            def half(text: str) -> str:
                """Says the text back."""
                return text
            '''
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for name, says in (("vague", "no docstring"), ("half", "no description")):
            with pytest.raises(ConfigError, match=f"'vaguetools:{name}' cannot be described"):
                tools_mod.resolve([f"vaguetools:{name}"])
            with pytest.raises(ConfigError, match=says):
                tools_mod.resolve([f"vaguetools:{name}"])
    finally:
        sys.modules.pop("vaguetools", None)
