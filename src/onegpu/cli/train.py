"""`onegpu train`: flags and YAML generated from the Config dataclasses."""

from __future__ import annotations

from typing import Sequence

from onegpu.cli.args import make_parser, parse
from onegpu.config import Config
from onegpu.logs import setup_logging


def cli(argv: Sequence[str]) -> int:
    parser = make_parser("onegpu train", "Train or fine-tune a causal LM. With no options: a small Llama "
                         "trained from scratch on the Python standard library's source.", Config)
    cfg, _ = parse(parser, argv, Config)
    setup_logging()
    from onegpu import train

    train(cfg)
    return 0
