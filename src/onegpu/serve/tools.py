"""Tool calls in a model's answer, read as the model's chat template taught it to write them, and
handed back as OpenAI's ``tool_calls`` (whole, or as stream deltas).

Two formats: Hermes/Qwen (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
text around them is content) and Llama 3's JSON (an answer that is ``{"name": ...,
"parameters": {...}}``, several joined by ``;``, after an optional ``<|python_tag|>``). Which one a
model uses is read from its template, or set with ``serve --tool_parser``. A forced call
(``tool_choice`` "required" or a named function) is the Constraint that makes the model write one;
for a model with no format, in vLLM's JSON form (``JSONCallReader``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional

from onegpu.infer.requests import Constraint
from onegpu.serve.json_schemas import closed, rebased

ParserName = Literal["auto", "hermes", "llama3", "none"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def parser_for(chat_template: Optional[str], choice: ParserName = "auto") -> Optional[str]:
    """The format a model writes its calls in: ``choice`` unless auto, else what its template
    shows (None: the template knows no tools)."""
    if choice != "auto":
        return None if choice == "none" else choice
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3"
    return None


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(text: str, args_key: str) -> Optional[Call]:
    """One call's JSON, or None when it is not one (the text then stays content)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesReader:
    """Splits a growing answer into content and ``<tool_call>`` blocks as its text arrives: text
    that may be the start of a tag is held back until it is known not to be one."""

    def __init__(self):
        self.buffer = ""
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        content, new = "", []
        while True:
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, HERMES_OPEN)
                cut = len(self.buffer) - keep
                content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                return content, new
            end = self.buffer.find(HERMES_CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                return content, new
            body = self.buffer[start + len(HERMES_OPEN) : end]
            call = _call(body.strip(), "arguments")
            if call is None:  # not a call after all: it is the model's text
                content += self.buffer[: end + len(HERMES_CLOSE)]
            else:
                content += self.buffer[:start]
                new.append(call)
            self.buffer = self.buffer[end + len(HERMES_CLOSE) :]

    def finish(self) -> tuple[str, list[Call]]:
        """The end of the answer: what is left is content (an unclosed tag included)."""
        rest, self.buffer = self.buffer, ""
        return rest, []


class Llama3Reader:
    """An answer that opens with ``{`` (or the python tag) is held to its end and read as calls;
    any other answer is content as it comes."""

    def __init__(self):
        self.buffer = ""
        self.mode: Optional[str] = None  # "content" or "calls", once the first text shows which

    def feed(self, text: str) -> tuple[str, list[Call]]:
        if self.mode == "content":
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return "", []
        if head.startswith(("{", PYTHON_TAG)):
            self.mode = "calls"
            return "", []
        self.mode, out, self.buffer = "content", self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[Call]]:
        text, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return text, []
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = [_call(part.strip(), "parameters") for part in _split_calls(body)]
        if not calls or any(c is None for c in calls):
            return text, []  # not calls: the answer is text
        return "", calls


def _split_calls(body: str) -> list[str]:
    """``{...}; {...}``: the JSON objects, split at the ``;`` between them."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p for p in parts if p.strip()]


def _partial_suffix(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that begin ``tag`` (held back: the tag may follow)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def reader(fmt: Optional[str], name: Optional[str] = None):
    """The reader of an answer's calls in ``fmt``; "json": a forced call in vLLM's JSON form (to
    the tool ``name``, or a list of calls when None)."""
    if fmt == "json":
        return JSONCallReader(name)
    return {"hermes": HermesReader, "llama3": Llama3Reader}[fmt]() if fmt else None


class JSONCallReader:
    """A forced call in vLLM's JSON form, for a model whose template shows no tool format: to a
    named tool the answer is its arguments (an object), for "required" a list of ``{"name",
    "parameters"}``. The grammar made the answer so: it is held to its end and read as calls;
    an answer cut short (``length``) stays content, as OpenAI returns a cut answer."""

    def __init__(self, name: Optional[str]):
        self.name, self.buffer = name, ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        return "", []

    def finish(self) -> tuple[str, list[Call]]:
        text, self.buffer = self.buffer, ""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if self.name is not None:
            if not isinstance(obj, dict):
                return text, []
            return "", [Call(self.name, json.dumps(obj, ensure_ascii=False))]
        if not isinstance(obj, list) or not obj:
            return text, []
        calls = [_call(json.dumps(item, ensure_ascii=False), "parameters") for item in obj]
        return ("", calls) if all(calls) else (text, [])


def forced_call(
    fmt: Optional[str], tools: list, name: Optional[str], strict: bool = True, parallel: bool = True
) -> Constraint:
    """The grammar of a forced call: to the named tool, or to any of ``tools`` (tool_choice
    "required"), with arguments that follow the tool's parameters schema (closed where it says
    nothing of other keys, with ``strict``). In ``fmt`` (hermes, llama3) one call; without a
    format vLLM's JSON form (``JSONCallReader``), a list of calls unless not ``parallel``. Each
    tool's schema sits under the wrapper's ``$defs`` with its references rebased, so its own
    ``$defs`` (pydantic's Enums and nested models) still resolve."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    params = [closed(t.parameters()) if strict else t.parameters() for t in chosen]
    if fmt is None and name is not None:  # vLLM: the arguments alone, the tool's own schema
        return Constraint("json_schema", json.dumps(params[0]))
    args_key = "parameters" if fmt in ("llama3", None) else "arguments"
    defs = {f"tool_{i}": rebased(p, f"/$defs/tool_{i}") for i, p in enumerate(params)}
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                args_key: {"$ref": f"#/$defs/tool_{i}"},
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for i, t in enumerate(chosen)
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if fmt is None:
        schema = {"type": "array", "items": one, "minItems": 1, "$defs": defs}
        if not parallel:
            schema["maxItems"] = 1
        return Constraint("json_schema", json.dumps(schema))
    schema = {**one, "$defs": defs}
    if fmt == "hermes":
        return Constraint(
            "json_schema", json.dumps(schema), HERMES_OPEN + "\n", "\n" + HERMES_CLOSE
        )
    return Constraint("json_schema", json.dumps(schema))
