"""JSON schemas as OpenAI and vLLM treat them, before they become grammars: objects closed where
``additionalProperties`` is left out (strict mode), a tool's schema moved inside a wrapper with its
``$ref`` pointers rewritten so they still resolve from the wrapper's root, and a schema checked
when a request arrives, its fault named by its path (``properties.unit.type``).

vLLM's default grammar backend (xgrammar in strict mode) and OpenAI's strict mode forbid the keys
a schema does not list; a grammar that allowed them lets a model invent keys until ``max_tokens``
(pydantic writes no ``additionalProperties`` for a plain model). ``serve --json_schema_strict
false`` keeps JSON Schema's own default (any other key allowed)."""

from __future__ import annotations

import json
from typing import Optional

# keywords whose value is one subschema, a list of them, or a map of name -> subschema: the walk
# goes only there (a "properties" key inside an enum value or a default is data, not schema)
ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
ONE += ("propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _subschemas(node: dict, fn) -> dict:
    """``node`` with ``fn`` applied to each of its direct subschemas (a new dict)."""
    out = dict(node)
    for key in ONE:
        if isinstance(node.get(key), dict):
            out[key] = fn(node[key])
        elif key == "items" and isinstance(node.get(key), list):
            out[key] = [fn(s) for s in node[key]]
    for key in MANY:
        if isinstance(node.get(key), list):
            out[key] = [fn(s) if isinstance(s, dict) else s for s in node[key]]
    for key in MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {k: fn(s) if isinstance(s, dict) else s for k, s in node[key].items()}
    return out


def closed(schema: dict) -> dict:
    """``schema`` with every object that lists ``properties`` and says nothing of other keys
    closed to them (``additionalProperties: false``). An object schema without ``properties``
    (``{"type": "object"}``, a free mapping) stays open: closing it would allow only ``{}``."""
    node = _subschemas(schema, closed)
    if "properties" in node and not any(k in node for k in OPEN_KEYS):
        node["additionalProperties"] = False
    return node


def rebased(schema: dict, pointer: str):
    """``schema`` to be placed at JSON pointer ``pointer`` of another document: each local
    ``$ref`` ("#/$defs/Color", "#") now points below it ("#<pointer>/$defs/Color")."""

    def walk(node):
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items() if k != "$ref"}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out["$ref"] = "#" + pointer + ref[1:]
            elif "$ref" in node:
                out["$ref"] = ref
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


class SchemaFault(ValueError):
    """A schema that is not one: ``path`` names the place inside it."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path or '(root)'}: {message}")
        self.path, self.message = path, message


def check_schema(schema) -> None:
    """Raise SchemaFault naming the path of the first fault of ``schema``: not an object, a
    keyword of the wrong type or value (JSON Schema's metaschema, when ``jsonschema`` is
    installed), or a local ``$ref`` that points nowhere."""
    if not isinstance(schema, dict):
        raise SchemaFault("", f"a schema is a JSON object, not {json.dumps(schema)[:40]}")
    try:
        import jsonschema
    except ImportError:  # the grammar compiler still refuses it, without a path
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise SchemaFault(path, exc.message) from None
    _check_refs(schema, schema, [])


def _check_refs(root: dict, node, path: list) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        local = isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))
        if local and _resolve(root, ref[1:]) is None:
            where = ".".join([*path, "$ref"])
            raise SchemaFault(where, f"'{ref}' points to nothing in this schema")
        for k, v in node.items():
            if k not in ("enum", "const", "default", "examples"):
                _check_refs(root, v, [*path, k])
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_refs(root, v, [*path, str(i)])


def _resolve(root, pointer: str) -> Optional[object]:
    """The value at JSON pointer ``pointer`` ("" is the root), or None."""
    if not pointer:
        return root
    node = root
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
