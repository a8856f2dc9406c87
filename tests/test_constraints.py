"""Structured output's matcher (llguidance) on the test tokenizer: over fuzzed JSON schemas, text
made by sampling random *allowed* tokens (random logits masked by the matcher's bitmask, as the
decode step will) always parses and validates against its schema; regex, choice and tool-call
grammars likewise; rollback returns to the same mask; a bad grammar is one clear error."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from onegpu.infer.constraints import (  # noqa: E402 - after the skips
    ConstraintError,
    Grammars,
    allocate_bitmask,
    fill_bitmask,
)
from onegpu.infer.logit_rules import apply_token_bitmask  # noqa: E402
from onegpu.infer.requests import Constraint  # noqa: E402

MAX_TOKENS = 3000


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    return Grammars(tiny_tokenizer)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -5, "maximum": 5}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["a", "bc", 3, None, True, "x y"], rng.randint(1, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "maxItems": rng.randint(0, 3),
        }
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["id", "name", "tags", "n", "ok", "sub"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def sample(grammars, tokenizer, constraint: Constraint, seed: int) -> tuple[str, bool]:
    """Random allowed tokens until the grammar ends or EOS is drawn: (text, ended)."""
    matcher = grammars.matcher(constraint)
    bitmask = allocate_bitmask(1, len(tokenizer))
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(MAX_TOKENS):
        assert fill_bitmask([matcher], bitmask)
        logits = apply_token_bitmask(torch.randn(1, len(tokenizer), generator=gen), bitmask)
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(ids), True
        assert matcher.accept(token), matcher.error()
        ids.append(token)
        if matcher.terminated():
            return tokenizer.decode(ids), True
    return tokenizer.decode(ids), False


def test_random_allowed_tokens_always_give_json_that_validates_against_fuzzed_schemas(
    grammars, tiny_tokenizer
):
    rng = random.Random(0)
    checked = 0
    for case in range(40):
        schema = random_schema(rng)
        if case % 4 == 0:  # objects at the top, as response_format has them
            schema = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
        text, ended = sample(
            grammars, tiny_tokenizer, Constraint("json_schema", json.dumps(schema)), case
        )
        assert ended, f"no end in {MAX_TOKENS} tokens: {schema} -> {text[:200]!r}"
        jsonschema.validate(json.loads(text), schema)
        checked += 1
    assert checked == 40


def test_json_object_regex_and_choice(grammars, tiny_tokenizer):
    for seed in range(5):
        text, _ = sample(grammars, tiny_tokenizer, Constraint("json_schema", ""), seed)
        assert isinstance(json.loads(text), dict)
        text, _ = sample(
            grammars, tiny_tokenizer, Constraint("regex", r"[a-c]{2,4}-[0-9]{3}"), seed
        )
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text), text
        choices = ["yes", "no", 'say "maybe"']
        text, _ = sample(grammars, tiny_tokenizer, Constraint("choice", json.dumps(choices)), seed)
        assert text in choices


def test_a_forced_tool_call_parses_as_a_call_with_valid_arguments(grammars, tiny_tokenizer):
    from onegpu.serve.messages import Tool
    from onegpu.serve.tools import HermesReader, forced_call

    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    }
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": params}})
        for n in ("weather", "time")
    ]
    for seed in range(5):
        for name in ("time", None):
            text, ended = sample(grammars, tiny_tokenizer, forced_call("hermes", tools, name), seed)
            reader = HermesReader()
            content, calls = reader.feed(text)
            assert ended and content == "" and len(calls) == 1, text
            assert calls[0].name == (name or calls[0].name) and calls[0].name in ("weather", "time")
            jsonschema.validate(json.loads(calls[0].arguments), params)


def test_json_inside_literal_text_is_as_compact_as_json_alone(grammars, tiny_tokenizer):
    """A forced call's JSON sits inside its tags: no whitespace where compact JSON has none
    (any whitespace there lets a weak model write newlines until its limit)."""
    from onegpu.infer.logit_rules import unpack_bitmask

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    bitmask = allocate_bitmask(1, len(tiny_tokenizer))
    spaces = [
        i for i in range(len(tiny_tokenizer)) if tiny_tokenizer.decode([i]) in (" ", "\n", "\t")
    ]
    assert spaces
    for constraint, text in (
        (Constraint("json_schema", schema), "{"),
        (Constraint("json_schema", schema, "<tool_call>\n", "\n</tool_call>"), "<tool_call>\n{"),
    ):
        matcher = grammars.matcher(constraint)
        for t in tiny_tokenizer(text, add_special_tokens=False)["input_ids"]:
            assert matcher.accept(t)
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, len(tiny_tokenizer))[0]
        assert not allowed[spaces].any(), text


def test_rollback_returns_to_the_same_mask(grammars, tiny_tokenizer):
    matcher = grammars.matcher(Constraint("json_schema", json.dumps({"type": "object"})))
    ids = tiny_tokenizer('{"a": [1, 2', add_special_tokens=False)["input_ids"]
    masks = []
    bitmask = allocate_bitmask(1, len(tiny_tokenizer))
    for t in ids:
        matcher.fill_bitmask(bitmask, 0)
        masks.append(bitmask.clone())
        assert matcher.accept(t)
    matcher.rollback(3)
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, masks[-3])


def test_rows_without_a_matcher_allow_every_token(grammars, tiny_tokenizer):
    bitmask = torch.zeros(2, (len(tiny_tokenizer) + 31) // 32, dtype=torch.int32)
    assert not fill_bitmask([None, None], bitmask)
    assert (bitmask == -1).all()
    matcher = grammars.matcher(Constraint("regex", "a"))
    assert fill_bitmask([None, matcher], bitmask)
    assert (bitmask[0] == -1).all() and not (bitmask[1] == -1).all()


@pytest.mark.parametrize(
    "constraint,words",
    [
        (Constraint("json_schema", "{nope"), "not valid JSON"),
        (Constraint("json_schema", json.dumps({"type": "wat"})), "wat"),
        (Constraint("regex", "(["), "regex"),
    ],
)
def test_a_grammar_that_does_not_compile_is_one_clear_error(grammars, constraint, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        grammars.check(constraint)
