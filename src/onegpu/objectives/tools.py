"""The tools a GRPO policy may call in its rollouts (grpo.tools), and the subprocess they run in.

A tool is a Python function of keyword arguments that returns text: a ``module:function``
reference, or a built-in by name. The model calls it by the function's name. Calls run one at a
time in a worker process (tool_worker.py), so a tool that hangs is killed at grpo.tool_timeout
and a tool that crashes its interpreter takes only the worker down; either way, and when a tool
raises, gets arguments that do not fit it or returns something other than a str, the model reads
an error message in place of the result and the run goes on. Each kind is counted
(``ToolRunner.counts``) for the training log.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from onegpu.errors import ConfigError

# built-in tools by name: their module:function
BUILTIN_TOOLS = {"calculator": "onegpu.objectives.calculator:calculator"}
# seconds the worker may take to start and import the tools (not counted in a call's time limit)
STARTUP_S = 120
# the kinds of failure counted in the log (tool_errors/<kind>)
ERRORS = ("raised", "timeout", "non_text", "crashed", "unknown_tool", "bad_arguments")


@dataclass(frozen=True)
class Tool:
    name: str  # what the model calls it: the function's name
    ref: str  # module:function, as the worker imports it
    # the function's JSON schema (transformers' get_json_schema: its name, the docstring's
    # description and arguments), what the chat template's ``tools`` shows the model
    schema: dict = field(default_factory=dict, compare=False, hash=False)


def resolve(entries: list[str]) -> list[Tool]:
    """grpo.tools as Tools, each imported here once (before any model loads), so a reference that
    does not import is one clear error now, not an error message in every rollout."""
    from onegpu.objectives.rewards import _search_working_directory

    _search_working_directory()
    out: dict[str, Tool] = {}
    for entry in entries:
        ref = BUILTIN_TOOLS.get(entry, entry)
        module, _, attr = ref.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"grpo.tools: cannot import '{entry}': {exc}.",
                hint="check the module is on PYTHONPATH (or in the working directory) and "
                "defines the function",
            ) from None
        if not callable(fn):
            raise ConfigError(
                f"grpo.tools: '{entry}' is a {type(fn).__name__}, not a function.",
                hint="point it at a function of keyword arguments that returns text",
            )
        name = getattr(fn, "__name__", attr)
        if name in out:
            raise ConfigError(
                f"grpo.tools: two tools are called '{name}' ({out[name].ref} and {ref}).",
                hint="the model calls a tool by its function's name: rename one",
            )
        out[name] = Tool(name, ref, _schema(fn, entry))
    return list(out.values())


def schemas(entries: list[str]) -> list[dict]:
    """The JSON schemas of grpo.tools, in their order: the chat template's ``tools`` (every
    prompt and every turn is rendered with them, as TRL's GRPOTrainer does)."""
    return [t.schema for t in resolve(entries)]


def _schema(fn, entry: str) -> dict:
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ConfigError(
            f"grpo.tools: '{entry}' cannot be described to the model: {exc}",
            hint="give the function type hints and a Google-style docstring (a description, "
            "then 'Args:' with a line per argument), as the chat template's tools need",
        ) from None


class ToolRunner:
    """Runs tool calls in a worker process, one at a time, each within ``timeout`` seconds. The
    worker starts at the first call and again after one it was killed for; ``close`` ends it."""

    def __init__(self, tools: list[Tool], timeout: float):
        self.tools = {t.name: t for t in tools}
        self.timeout = timeout
        self.counts: Counter = Counter()  # tool_calls, and tool_errors/<kind>
        self._proc: Optional[subprocess.Popen] = None

    def call(self, name: str, arguments: str) -> tuple[str, Optional[str]]:
        """(the text the model reads, the kind of error or None) of one call; ``arguments`` is
        the call's JSON text."""
        self.counts["tool_calls"] += 1
        tool = self.tools.get(name)
        if tool is None:
            return self._error(
                "unknown_tool", f"no tool named '{name}' (tools: {', '.join(self.tools)})"
            )
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return self._error("bad_arguments", f"the arguments are not JSON: {exc}")
        if not isinstance(args, dict):
            return self._error("bad_arguments", "the arguments must be a JSON object")
        proc = self._worker()
        proc.stdin.write(json.dumps({"ref": tool.ref, "args": args}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
        if not ready:
            self._kill()
            return self._error("timeout", f"'{name}' ran past the {self.timeout:g} s time limit")
        line = proc.stdout.readline()
        if not line:
            code = proc.wait()
            self._proc = None
            return self._error("crashed", f"'{name}' ended its process (exit code {code})")
        reply = json.loads(line)
        if "ok" in reply:
            return reply["ok"], None
        verb = "raised " if reply["error"] == "raised" else ""
        return self._error(reply["error"], f"'{name}' {verb}{reply['message']}")

    def _error(self, kind: str, message: str) -> tuple[str, str]:
        self.counts[f"tool_errors/{kind}"] += 1
        return f"error: {message}", kind

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # the worker imports what this process can: its sys.path, the working directory
            # included (rewards._search_working_directory)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
            worker = str(Path(__file__).with_name("tool_worker.py"))
            refs = [t.ref for t in self.tools.values()]
            self._proc = subprocess.Popen(
                [sys.executable, worker, *refs],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                encoding="utf-8",
                env=env,
            )
            ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_S)
            if not ready or not self._proc.stdout.readline():
                self._kill()
                raise RuntimeError(
                    f"the tool worker did not start within {STARTUP_S} s (tools: {refs})"
                )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __del__(self):
        self._kill()
