"""`onegpu export`: write a run's model (or any model folder, with an adapter) as merged
safetensors, GGUF or an Ollama folder, and check the export in its runtime against onegpu's
engine; flags come from ExportConfig (onegpu.export.config)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from onegpu.cli.args import add_options, make_parser, parse
from onegpu.errors import ConfigError

DESCRIPTION = (
    "Export a trained model for deployment: onegpu export runs/<name> --format "
    "safetensors,gguf,ollama --quant q8_0 (merged 16-bit for transformers, vLLM and SGLang; GGUF "
    "for llama.cpp; a GGUF and a Modelfile for Ollama). The export is written to a temporary "
    "folder and renamed when whole, then loaded in its runtime and compared with onegpu's engine "
    "on the source model (export-check.json beside it; --check off skips)."
)


def build_parser():
    from jsonargparse import ActionConfigFile

    from onegpu.export.config import ExportConfig

    parser = make_parser(
        "onegpu export", DESCRIPTION, usage="onegpu export MODEL [--format F] [options]"
    )
    parser.add_argument(
        "--config", action=ActionConfigFile, metavar="FILE", help="YAML file with the options"
    )
    parser.add_argument("source", nargs="?", default=None, help="run folder or model folder")
    add_options(parser, ExportConfig, "export", ExportConfig.__doc__)
    return parser


def cli(argv: Sequence[str]) -> int:
    from onegpu.config import from_dict
    from onegpu.export import export
    from onegpu.export.config import ExportConfig

    _, ns = parse(build_parser(), argv)
    raw = ns.as_dict()
    source = raw.pop("source", None)
    if source and raw.get("model") and source != raw["model"]:
        raise ConfigError(
            f"two models given: '{source}' and --model {raw['model']}.", hint="give one of them"
        )
    raw["model"] = source or raw.get("model") or ""
    names = {f.name for f in dataclasses.fields(ExportConfig)}
    cfg = from_dict({k: v for k, v in raw.items() if k in names}, ExportConfig)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    result = export(cfg)
    return 0 if result.passed else 1
