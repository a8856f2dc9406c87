"""`onegpu train`: flags and YAML generated from the Config dataclasses (``--section.field``;
``--model X`` is short for ``--model.name X``)."""

from __future__ import annotations

from collections.abc import Sequence

from onegpu.cli.args import make_parser, model_shorthand, note_model_shorthand, parse
from onegpu.config import Config

__all__ = ["build_parser", "cli", "model_shorthand"]


def build_parser():
    parser = make_parser(
        "onegpu train",
        "Train or fine-tune a causal LM. With no options: a small Llama "
        "trained from scratch on the Python standard library's source.",
        Config,
    )
    note_model_shorthand(parser)
    return parser


def cli(argv: Sequence[str]) -> int:
    # logging is set up once by `onegpu` (cli/main.py), with --debug's verbosity
    cfg, _ = parse(build_parser(), model_shorthand(argv), Config)
    from onegpu import train

    train(cfg)
    return 0
