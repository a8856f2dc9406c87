"""A renderer for the part of Go's text/template that Ollama's chat templates use over
``.Messages``: ``{{ range .Messages }}``, ``{{ if eq .Role "user" }}`` / ``else if`` / ``else`` /
``end``, ``{{ .Content }}``, ``{{ .Role }}`` and string literals ``{{ "..." }}``, with Go's
``{{-`` / ``-}}`` whitespace trimming. It parses the template text, so a template that is not
well formed in that grammar (an unclosed block, an unknown action) is an error, as in Ollama."""

from __future__ import annotations

import json
import re

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class TemplateError(ValueError):
    pass


def parse(template: str) -> list:
    """Tokens: ("text", s) and ("action", words); trimming applied to the text beside actions."""
    out: list = []
    pos = 0
    for m in ACTION.finditer(template):
        text = template[pos : m.start()]
        if m.group(1):
            text = text.rstrip()
        out.append(["text", text])
        out.append(["action", m.group(2), bool(m.group(3))])
        pos = m.end()
    out.append(["text", template[pos:]])
    for i, tok in enumerate(out):  # a "-}}" trims the text after it
        if tok[0] == "action" and tok[2] and i + 1 < len(out):
            out[i + 1][1] = out[i + 1][1].lstrip()
    return _tree(iter(out), top=True)


def _tree(tokens, top: bool = False):
    """Nested blocks: ("range", body), ("if", [(cond, body), ...]), ("text", s), ("expr", e)."""
    body: list = []
    for tok in tokens:
        if tok[0] == "text":
            if tok[1]:
                body.append(("text", tok[1]))
            continue
        words = tok[1]
        if words == "range .Messages":
            inner, end = _tree(tokens)
            _expect(end, "end", words)
            body.append(("range", inner))
        elif words.startswith("if "):
            branches, cond = [], words[3:]
            while True:
                inner, end = _tree(tokens)
                branches.append((cond, inner))
                if end.startswith("else if "):
                    cond = end[len("else if ") :]
                elif end == "else":
                    cond = "true"
                else:
                    _expect(end, "end", words)
                    break
            body.append(("if", branches))
        elif words == "end" or words == "else" or words.startswith("else if "):
            if top:
                raise TemplateError(f"unexpected {{{{ {words} }}}}")
            return body, words
        else:
            body.append(("expr", words))
    if not top:
        raise TemplateError("a block is not closed with {{ end }}")
    return body


def _expect(end: str, want: str, opened: str) -> None:
    if end != want:
        raise TemplateError(f"{{{{ {opened} }}}} closed by {{{{ {end} }}}}")


def render(template: str, messages: list[dict]) -> str:
    return _run(parse(template), messages, None)


def _run(body, messages, message) -> str:
    out = []
    for node in body:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "range":
            out += [_run(node[1], messages, m) for m in messages]
        elif kind == "if":
            for cond, inner in node[1]:
                if _true(cond, message):
                    out.append(_run(inner, messages, message))
                    break
        else:
            out.append(_value(node[1], message))
    return "".join(out)


def _true(cond: str, message) -> bool:
    if cond == "true":
        return True
    m = re.fullmatch(r'eq \.(Role|Content) ("(?:[^"\\]|\\.)*")', cond)
    if not m:
        raise TemplateError(f"unsupported condition {cond!r}")
    return _field(m.group(1), message) == json.loads(m.group(2))


def _value(expr: str, message) -> str:
    if expr.startswith('"'):
        return json.loads(expr)
    m = re.fullmatch(r"\.(Role|Content)", expr)
    if not m:
        raise TemplateError(f"unsupported action {{{{ {expr} }}}}")
    return _field(m.group(1), message)


def _field(name: str, message) -> str:
    if message is None:
        raise TemplateError(f".{name} outside {{{{ range .Messages }}}}")
    return str(message[name.lower()])
