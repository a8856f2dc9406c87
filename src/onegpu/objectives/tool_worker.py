"""The process GRPO's tool calls run in (objectives/tools.ToolRunner starts it by path, so it
imports neither onegpu nor torch unless a tool does): one JSON request a line on stdin, one JSON
reply a line on the original stdout.

Its arguments are the tools' ``module:function`` references, imported before it says it is ready.
A request is ``{"ref": "module:function", "args": {...}}``; the reply ``{"ok": text}`` or
``{"error": kind, "message": text}`` with kind ``raised`` (the tool raised, or its arguments did
not fit it) or ``non_text`` (it returned something other than a str). What a tool prints goes to
stderr, so it cannot corrupt the replies.
"""

import importlib
import json
import os
import sys


def main() -> None:
    # started by path, its own folder comes first on sys.path: it holds modules (tools.py,
    # rewards.py, ...) that would shadow a user's of the same name
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a tool's prints go to stderr
    sys.stdout = sys.stderr
    functions = {}
    for ref in sys.argv[1:]:  # imported before the first call: its time limit is the call's own
        module, _, name = ref.partition(":")
        functions[ref] = getattr(importlib.import_module(module), name)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        replies.write(json.dumps(_call(functions, request["ref"], request["args"])) + "\n")
        replies.flush()


def _call(functions: dict, ref: str, args: dict) -> dict:
    try:
        if ref not in functions:
            module, _, name = ref.partition(":")
            functions[ref] = getattr(importlib.import_module(module), name)
        result = functions[ref](**args)
    except Exception as exc:  # noqa: BLE001 - any failure of the tool goes back to the model
        return {"error": "raised", "message": f"{type(exc).__name__}: {exc}"}
    if not isinstance(result, str):
        return {"error": "non_text", "message": f"returned {type(result).__name__}, not text"}
    return {"ok": result}


if __name__ == "__main__":
    main()
