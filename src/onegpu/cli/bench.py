"""`onegpu bench <what> ...`: measured comparisons, one module per benchmark (each with
``cli(argv)``)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Sequence

from onegpu.errors import ConfigError

# name -> (module, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "infer": (
        "onegpu.bench.infer",
        "generation speed, memory and quality per dtype/quantization/compile setting",
    ),
    "train": (
        "onegpu.bench.train",
        "the training guide's methods, one arm each, interleaved, next to HF Trainer",
    ),
}


def cli(argv: Sequence[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: onegpu bench <benchmark> [options]   (onegpu bench <benchmark> "
            "--help)\n\nbenchmarks:"
        )
        for name, (_, desc) in BENCHMARKS.items():
            print(f"  {name:<8} {desc}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        close = difflib.get_close_matches(name, BENCHMARKS, n=1)
        hint = (
            f"did you mean 'onegpu bench {close[0]}'?"
            if close
            else f"choose one of: {', '.join(BENCHMARKS)}"
        )
        raise ConfigError(f"unknown benchmark '{name}'.", hint=hint)
    return int(importlib.import_module(BENCHMARKS[name][0]).cli(rest) or 0)
