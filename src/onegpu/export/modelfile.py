"""A Modelfile checked against Ollama's documented grammar (docs/modelfile.md): one instruction per
line (FROM, PARAMETER, TEMPLATE, SYSTEM, ADAPTER, LICENSE, MESSAGE; # comments), FROM required,
PARAMETER names and value types from its table, triple-quoted values closed."""

from __future__ import annotations

import re

INSTRUCTIONS = ("FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE")
# Ollama's documented parameters and their types
PARAMETERS = {
    "num_ctx": int,
    "repeat_last_n": int,
    "repeat_penalty": float,
    "temperature": float,
    "seed": int,
    "stop": str,
    "num_predict": int,
    "top_k": int,
    "top_p": float,
    "min_p": float,
}


class ModelfileError(ValueError):
    pass


def validate_modelfile(text: str) -> list[tuple[str, str]]:
    """The instructions as (NAME, argument); ModelfileError naming the line otherwise."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        n, line = i + 1, lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        name, _, arg = line.partition(" ")
        if name.upper() not in INSTRUCTIONS:
            raise ModelfileError(f"Modelfile line {n}: unknown instruction {name!r}")
        arg = arg.strip()
        if arg.startswith('"""'):
            body = arg[3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise ModelfileError(f'Modelfile line {n}: """ is never closed')
                body += "\n" + lines[i]
                i += 1
            arg, rest = body.split('"""', 1)
            if rest.strip():
                raise ModelfileError(f'Modelfile line {n}: text after the closing """')
        if name.upper() == "PARAMETER":
            _parameter(arg, n)
        out.append((name.upper(), arg))
    if not any(name == "FROM" for name, _ in out):
        raise ModelfileError("Modelfile has no FROM instruction")
    return out


def _parameter(arg: str, n: int) -> None:
    key, _, value = arg.partition(" ")
    if key not in PARAMETERS:
        raise ModelfileError(f"Modelfile line {n}: unknown parameter {key!r}")
    kind = PARAMETERS[key]
    value = value.strip()
    ok = (
        bool(re.fullmatch(r'"(?:[^"\\]|\\.)*"|\S+', value))
        if kind is str
        else bool(re.fullmatch(r"-?\d+" if kind is int else r"-?\d+(\.\d+)?", value))
    )
    if not ok:
        raise ModelfileError(f"Modelfile line {n}: {key} takes {kind.__name__}, got {value!r}")
