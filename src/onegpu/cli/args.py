"""Command-line parsing generated from the config dataclasses (jsonargparse), with clear errors.

Every dataclass field becomes ``--section.field``; ``--config file.yaml`` loads a YAML file first
(later flags override it). Unknown flags or keys and bad values raise one ``ConfigError`` naming
the field, with a did-you-mean where a close name exists.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, Sequence

from onegpu.errors import ConfigError


def make_parser(prog: str, description: str, config_cls: type | None = None):
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    try:  # field docstrings become --help text
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    except (TypeError, ValueError):  # older jsonargparse: help without field docs
        pass
    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, env_prefix="ONEGPU",
                            allow_abbrev=False)  # a shortened flag is a typo, not a guess to act on
    if config_cls is not None:
        parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
        parser.add_class_arguments(config_cls, fail_untyped=False)
    return parser


def parse(parser, argv: Sequence[str], config_cls: type | None = None) -> Any:
    """Parse argv; return (config dataclass or None, namespace)."""
    argv = list(argv)
    if config_cls is not None:
        _check_yaml_files(argv, config_cls)
    try:
        ns = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        if isinstance(exc, SystemExit):
            if exc.code in (0, None):  # --help
                raise
            raise ConfigError("invalid command line.", hint=f"see '{parser.prog} --help'") from None
        raise _friendly(parser, str(exc)) from None
    if config_cls is None:
        return None, ns
    from onegpu.config import from_dict, validate

    raw = ns.as_dict()
    names = {f for f in config_cls.__dataclass_fields__}
    cfg = from_dict({k: _plain(v) for k, v in raw.items() if k in names}, config_cls)
    if hasattr(cfg, "training"):
        validate(cfg)
    return cfg, ns


def _plain(v: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v


def _check_yaml_files(argv: list[str], config_cls: type) -> None:
    """Validate --config files with our own loader first: its errors name the key and suggest one."""
    from onegpu.config import from_dict, load_yaml

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path:
            from_dict(load_yaml(path), config_cls)


def _friendly(parser, message: str) -> ConfigError:
    options = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    m = re.search(r"unrecognized arguments: (\S+)", message)
    if m:
        flag = m.group(1).split("=")[0]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"see '{parser.prog} --help'"
        return ConfigError(f"unknown option '{flag}'.", hint=hint)
    m = re.search(r'key "([^"]+)":\s*(.*?)Got value: (.*)', message, re.S)
    if m:
        key, expected, got = m.group(1), " ".join(m.group(2).split()), m.group(3).strip()
        choices = re.findall(r"'([^']+)'", expected) if "Literal" in expected else []
        close = difflib.get_close_matches(got, choices, n=1)
        hint = f"did you mean '{close[0]}'?" if close else (f"choose one of: {', '.join(choices)}" if choices else expected)
        return ConfigError(f"{key}: invalid value '{got}'.", hint=hint)
    return ConfigError(" ".join(message.split()), hint=f"see '{parser.prog} --help'")
