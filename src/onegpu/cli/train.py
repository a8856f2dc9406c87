"""`onegpu train`: flags and YAML generated from the Config dataclasses."""

from __future__ import annotations

from typing import Sequence

from onegpu.cli.args import make_parser, parse
from onegpu.config import Config
from onegpu.logs import setup_logging


def cli(argv: Sequence[str]) -> int:
    parser = make_parser("onegpu train", "Train or fine-tune a causal LM. With no options: a small Llama "
                         "trained from scratch on the Python standard library's source.", Config)
    cfg, _ = parse(parser, model_shorthand(argv), Config)
    setup_logging()
    from onegpu import train

    train(cfg)
    return 0


def model_shorthand(argv: Sequence[str]) -> list[str]:
    """`--model X` means `--model.name X` (as for `onegpu generate`). The parser would read a bare
    `--model` as a YAML file for the whole section and fail on a model folder or Hub id with an
    error about config files; a .yaml/.yml/.json value keeps that meaning."""
    out = list(argv)
    files = (".yaml", ".yml", ".json")
    for i, arg in enumerate(out):
        if arg == "--model" and i + 1 < len(out) and not out[i + 1].endswith(files):
            out[i] = "--model.name"
        elif arg.startswith("--model=") and not arg.endswith(files):
            out[i] = "--model.name=" + arg.split("=", 1)[1]
    return out
