"""Structured output: a request's Constraint (a JSON schema, a regex, a choice of strings, a Lark
or GBNF grammar, with literal text around a JSON schema) compiled for the model's tokenizer into a
per-request matcher that says, token by token, which tokens may come next.

The grammar library is llguidance (chosen by measurement against xgrammar and outlines-core:
benchmarks/results/grammar-libs-cpu.md); it is an optional extra, ``pip install
'onegpu[structured]'``, imported when a server first needs it.

The seam with the decode step: each step, one int32 bitmask [rows, ceil(vocab / 32)] on the host,
``fill_bitmask`` writing the rows that have a matcher and leaving every other row all ones; the step
moves it to the device and calls ``logit_rules.apply_token_bitmask`` before sampling (with
``rows=``, the constrained rows' indices, the others are not touched), then hands
each constrained row's sampled token to ``Matcher.accept``. A row whose matcher is ``terminated``
has finished its grammar (its only allowed token then is EOS)."""

from __future__ import annotations

import json
from typing import Optional, Protocol

import torch

from onegpu.errors import ConfigError, UnavailableError
from onegpu.infer.logit_rules import bitmask_words
from onegpu.infer.requests import Constraint

# Compact JSON with the separators json.dumps writes: no runs of whitespace for a model to loop in.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Matcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, on the CPU)."""

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    def terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` accepted tokens (speculative decoding, a stop string cut)."""


class ConstraintError(ConfigError):
    """A request's grammar that does not compile: the caller's 400, naming the reason."""


def available() -> bool:
    """Whether llguidance is installed (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise UnavailableError(
            "structured output needs llguidance, which is not installed.",
            hint="pip install 'onegpu[structured]'",
        ) from None
    return llguidance


class LLGuidanceMatcher:
    def __init__(self, matcher):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _llguidance().torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def terminated(self) -> bool:
        return self._m.is_stopped()

    def accepting(self) -> bool:
        """The text so far is a whole answer (EOS may come now)."""
        return self._m.is_accepting()

    def rollback(self, tokens: int) -> None:
        if not self._m.rollback(tokens):
            raise ConfigError(f"cannot roll back {tokens} tokens: {self._m.get_error()}")

    def error(self) -> Optional[str]:
        return self._m.get_error() if self._m.is_error() else None


class Grammars:
    """Compiles Constraints for one tokenizer (its vocabulary prepared once). ``vocab``: the
    model's logit width when its embedding is padded past the tokenizer."""

    def __init__(self, tokenizer, vocab: Optional[int] = None):
        ll = _llguidance()
        self.vocab = vocab or len(tokenizer)
        self.tokenizer = ll.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)

    def grammar(self, c: Constraint) -> str:
        """The llguidance grammar of ``c`` (a Lark grammar with its JSON and regex parts)."""
        ll = _llguidance()
        if c.kind == "json_schema":
            schema = _schema(c.value)
            body = ll.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
            if not (c.before or c.after):
                return body
            # inside a Lark grammar the JSON's options ride in the schema (as the schema's own
            # x-guidance would, over the defaults): without them %json takes any whitespace, and
            # a weak model writes newlines for ever
            options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
            inner = json.dumps({**schema, "x-guidance": options})
            return f"start: {_lit(c.before)} answer {_lit(c.after)}\nanswer: %json {inner}\n"
        if c.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(c.value)
        if c.kind == "choice":
            choices = json.loads(c.value)
            return "start: " + " | ".join(_lit(s) for s in choices) + "\n"
        if c.kind == "grammar":  # Lark, or llama.cpp's GBNF (converted), as vLLM's guidance
            try:
                return ll.grammar_from("grammar", c.value)
            except ValueError as exc:
                raise ConstraintError(f"the grammar does not compile: {exc}") from None
        raise ConstraintError(f"unknown constraint kind '{c.kind}'")

    def check(self, c: Constraint) -> None:
        """Raise ConstraintError naming what is wrong with ``c``."""
        self.matcher(c)

    def matcher(self, c: Constraint) -> LLGuidanceMatcher:
        ll = _llguidance()
        m = ll.LLMatcher(self.tokenizer, self.grammar(c), log_level=0)
        if m.is_error():
            raise ConstraintError(f"the {_what(c)} does not compile: {m.get_error()}")
        return LLGuidanceMatcher(m)


def _schema(text: str) -> dict:
    if not text:
        return {"type": "object"}  # json_object: any JSON object
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be a JSON object.")
    return schema


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes), or nothing for empty text."""
    return json.dumps(text) if text else ""


def _what(c: Constraint) -> str:
    names = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice"}
    return names.get(c.kind, c.kind)


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the CPU, every token allowed."""
    return torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32)


def fill_bitmask(matchers: list, bitmask: torch.Tensor) -> bool:
    """Each row with a matcher gets its allowed tokens; a row without one (None) is all ones.
    True if any row is constrained (else the step may skip the mask)."""
    any_row = False
    for row, m in enumerate(matchers):
        if m is None:
            bitmask[row].fill_(-1)
        else:
            m.fill_bitmask(bitmask, row)
            any_row = True
    return any_row
