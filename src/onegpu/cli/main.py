"""`onegpu <command> ...`: each command lives in its own module and exposes ``cli(argv) -> int``.

Dispatching by name (instead of building every sub-parser up front) keeps `onegpu --help` fast:
heavy imports (torch, transformers) happen only inside the chosen command.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from onegpu.errors import ConfigError, OnegpuError

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "onegpu.cli.train",
        "train or fine-tune a causal LM (default: a small model on the stdlib source)",
    ),
    "generate": (
        "onegpu.cli.generate",
        "sample text from a trained run or any Hugging Face causal LM",
    ),
    "serve": (
        "onegpu.cli.serve",
        "serve a model and its LoRA adapters over an OpenAI-compatible HTTP API",
    ),
    "export": (
        "onegpu.cli.export",
        "export a trained model (safetensors, GGUF, Ollama) and check it in its runtime",
    ),
    "plan": (
        "onegpu.cli.plan",
        "predict memory and speed of training setups on a GPU; print the fastest that fits",
    ),
    "doctor": (
        "onegpu.cli.doctor",
        "show versions, the GPU and which fast paths work here (what to install if not)",
    ),
    "bench": (
        "onegpu.cli.bench",
        "measure methods on this device: onegpu bench infer (speed, memory, quality)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        return 0
    if argv[0] in ("-V", "--version"):
        from onegpu import __version__

        print(f"onegpu {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean 'onegpu {close[0]}'?" if close else "run 'onegpu --help' for the list"
        return _fail(ConfigError(f"unknown command '{name}'.", hint=hint), debug)
    from onegpu.logs import setup_logging

    setup_logging(verbose=debug)
    return run_command(lambda: importlib.import_module(COMMANDS[name][0]).cli(rest), debug)


def run_command(fn: Callable[[], int | None], debug: bool = False) -> int:
    """Run a command; user errors print one clear message (a traceback only with --debug)."""
    try:
        return int(fn() or 0)
    except OnegpuError as exc:
        return _fail(exc, debug)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _fail(exc: BaseException, debug: bool) -> int:
    if debug or os.environ.get("ONEGPU_DEBUG"):
        import traceback

        traceback.print_exception(exc)
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _print_help() -> None:
    print("usage: onegpu <command> [options]   (onegpu <command> --help for its options)\n")
    print("commands:")
    for name, (_, desc) in COMMANDS.items():
        print(f"  {name:<10} {desc}")
    print("\nglobal flags: --debug (show tracebacks), --version")


if __name__ == "__main__":
    sys.exit(main())
