"""`onegpu serve`: an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics) on the decode engine; flags come from InferConfig (how the model is loaded) and
ServeConfig (where it listens, adapters, how much runs at once)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from onegpu.cli.args import add_options, make_parser, parse

DESCRIPTION = (
    "Serve a model over OpenAI's API: onegpu serve --model runs/<name> [--adapter NAME=DIR ...]. "
    "Binds 127.0.0.1:8000 unless told otherwise; SIGTERM finishes the requests in flight, "
    "then exits."
)
# InferConfig's single adapter is replaced by serve's named ones; merging would fix one adapter in
SKIP = {"adapter", "merge_adapter"}


def build_parser():
    from jsonargparse import ActionConfigFile

    from onegpu.infer import InferConfig
    from onegpu.serve.config import ServeConfig

    parser = make_parser(
        "onegpu serve",
        DESCRIPTION,
        usage="onegpu serve --model MODEL [--adapter NAME=DIR] [options]",
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        metavar="FILE",
        help="YAML file with any of the options",
    )
    add_options(parser, InferConfig, "model", "Which model to load, and how.", skip=SKIP)
    add_options(parser, ServeConfig, "server", ServeConfig.__doc__)
    for action in parser._actions:
        if "--adapter" in action.option_strings:
            action.metavar = "NAME=DIR"
    return parser


def cli(argv: Sequence[str]) -> int:
    from onegpu.config import from_dict
    from onegpu.infer import InferConfig
    from onegpu.serve.config import ServeConfig
    from onegpu.serve.launch import serve

    _, ns = parse(build_parser(), repeatable(argv, "--adapter"))
    raw = ns.as_dict()
    icfg = from_dict(_fields(raw, InferConfig, SKIP), InferConfig)
    scfg = from_dict(_fields(raw, ServeConfig), ServeConfig)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return serve(icfg, scfg)


def repeatable(argv: Sequence[str], flag: str) -> list[str]:
    """`--adapter a=x --adapter b=y` adds one each (jsonargparse alone would keep the last)."""
    out: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == flag and args:
            out += [flag + "+", args.pop(0)]
        elif arg.startswith(flag + "="):
            out += [flag + "+", arg.split("=", 1)[1]]
        else:
            out.append(arg)
    return out


def _fields(raw: dict, cls: type, skip: set = frozenset()) -> dict:
    return {
        f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw and f.name not in skip
    }
