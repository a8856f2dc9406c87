"""Command-line parsing generated from the config dataclasses (jsonargparse), with clear errors.

One flag style for every command: underscores, never hyphens (``--max_new_tokens``); a setting of
the training config is ``--section.field`` (``--data.seq_len``) wherever a command takes it, so a
train command line works for ``onegpu plan`` too. ``--config file.yaml`` loads a YAML file first
(later flags override it). Unknown flags or keys and bad values raise one ``ConfigError`` naming
the field, with a did-you-mean where a close name exists. Flags that were renamed keep working
through ``renamed()``, which names the new spelling.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from onegpu.config.names import suggest_flag
from onegpu.errors import ConfigError

# jsonargparse titles a group with the dataclass's signature when the field has no docstring
_SIGNATURE = re.compile(r"^\w+\(.*\)$", re.S)


def make_parser(
    prog: str,
    description: str,
    config_cls: type | None = None,
    usage: str | None = None,
    skip: Iterable[str] = (),
):
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    try:  # field docstrings become --help text
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    except (TypeError, ValueError):  # older jsonargparse: help without field docs
        pass
    if (
        usage is None and config_cls is not None
    ):  # the full list is below, grouped; 70 lines of it up here hide it
        usage = f"{prog} [--config FILE] [--section.field VALUE ...]"
    parser = ArgumentParser(
        prog=prog,
        description=description,
        usage=usage,
        exit_on_error=False,
        env_prefix="ONEGPU",
        formatter_class=_help_formatter(),
        allow_abbrev=False,
    )  # a shortened flag is a typo, not a guess to act on
    if config_cls is not None:
        parser.add_argument(
            "--config", action=ActionConfigFile, help="YAML file with any of the options below"
        )
        add_options(parser, config_cls, "run", skip=skip)
    return parser


def add_options(
    parser, config_cls: type, title: str, description: str | None = None, skip: Iterable[str] = ()
):
    """Every field of a config dataclass as a flag, grouped in --help by section: the heading is
    the section's flag prefix, the text under it the section's docstring (never the signature)."""
    parser.add_class_arguments(config_cls, fail_untyped=False, skip=set(skip) or None)
    titled = parser.__dict__.setdefault(
        "_onegpu_titled", set()
    )  # groups of earlier calls keep their titles
    for key, group in parser.groups.items():
        if key in titled:
            continue
        titled.add(key)
        text = group.title or ""
        if key == config_cls.__name__:  # the fields outside any section
            group.title, group.description = title, description
        else:  # a section: titled by its docstring when it has one, else by its signature
            group.title, group.description = key, None if _SIGNATURE.match(text) else text
    for action in parser._actions:  # `--data FILE`: a YAML file with that section alone
        if len(action.option_strings) == 1 and action.option_strings[0][2:] in parser.groups:
            action.help, action.metavar = "YAML file with this section's options", "FILE"
        if action.option_strings == ["--config"]:
            action.metavar = "FILE"


def _help_formatter():
    from jsonargparse import DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter):
        def _get_type_str(self, action):
            # "(type: Union[float, Literal['auto']])" is Python, not help: choices show in the
            # metavar, the docstring says what else a field takes; the default is still shown
            return None

        def _get_help_string(self, action):
            text = super()._get_help_string(action)
            if action.default is None:  # "(default: null)": no default is no news
                text = text.replace(" (default: %(default)s)", "").replace(
                    ", default: %(default)s", ""
                )
            return text

    return HelpFormatter


def renamed(argv: Sequence[str], names: dict[str, str]) -> list[str]:
    """Old spellings of renamed flags, rewritten to the new ones with one line each naming the new
    flag: scripts and notes written for the old name keep working while they are updated."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in names:
            print(
                f"note: {flag} is now {names[flag]} (the old spelling still works, for now)",
                file=sys.stderr,
            )
            arg = names[flag] + eq + value
        out.append(arg)
    return out


def note_model_shorthand(parser) -> None:
    """--help for the commands that read `--model X` through model_shorthand."""
    for action in parser._actions:
        if action.option_strings == ["--model"]:
            action.help, action.metavar = (
                "short for --model.name X; a .yaml file: this section's options",
                "X",
            )


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

    v = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    if isinstance(
        v, dict
    ):  # a section loaded from its own file (--model m.yaml) records its __path__
        return {k: _plain(x) for k, x in v.items() if k != "__path__"}
    return v


def _check_yaml_files(argv: list[str], config_cls: type) -> None:
    """Validate --config files with our own loader first: its errors name the key and suggest
    one."""
    from onegpu.config import from_dict, load_yaml

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        if path:
            from_dict(load_yaml(path), config_cls)


# jsonargparse names the expected type as a Python class; say it in words
TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _friendly(parser, message: str) -> ConfigError:
    options = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    m = re.search(r"unrecognized arguments: (\S+)", message)
    if m:
        flag = m.group(1).split("=")[0]
        close = suggest_flag(flag, options)
        hint = f"did you mean '{close}'?" if close else f"see '{parser.prog} --help'"
        return ConfigError(f"unknown option '{flag}'.", hint=hint)
    m = re.search(r'key "([^"]+)":\s*(.*?)Got value: (.*)', message, re.S) or re.search(
        r'key "([^"]+)":\s*(.*?)Given value: (.*)', message, re.S
    )
    if m:
        key, expected, got = m.group(1), " ".join(m.group(2).split()), m.group(3).strip()
        choices = re.findall(r"Literal\[([^\]]+)\]", expected) if "Literal" in expected else []
        choices = [c for group in choices for c in re.findall(r"'([^']+)'", group)]
        types = [
            TYPE_WORDS[t]
            for t in re.findall(r"Expected a <class '(\w+)'>", expected)
            if t in TYPE_WORDS
        ]
        if "Expected a <class 'list'>" in expected:  # a bare name where a list was due
            items = ", ".join(x.strip() for x in got.strip("[]").split(",") if x.strip())
            return ConfigError(
                f"{key} takes a list, got {got!r}.",
                hint=f"write it in brackets: --{key} '[{items}]' (several items: '[a, b]')",
            )
        if types:  # a number, or a number or "auto": the number is what went wrong
            words = f" (or {', '.join(dict.fromkeys(choices))})" if choices else ""
            return ConfigError(
                f"{key} must be {types[0]}, got {got!r}.",
                hint=f"write it as e.g. --{key} {_example(parser, key, types[0])}{words}",
            )
        close = difflib.get_close_matches(got, choices, n=1)
        hint = (
            f"did you mean '{close[0]}'?"
            if close
            else (f"choose one of: {', '.join(choices)}" if choices else expected)
        )
        return ConfigError(f"{key}: invalid value '{got}'.", hint=hint)
    return ConfigError(" ".join(message.split()), hint=f"see '{parser.prog} --help'")


def _example(parser, key: str, kind: str) -> str:
    """The field's default as an example value, when it is of the kind asked for."""
    try:
        value = parser.get_default(key)
    except Exception:  # noqa: BLE001 - an example is a nicety
        value = None
    if kind == "true or false":
        return "true"
    if value == "auto":  # settled by mode (hyper.py): the from-scratch number is a sensible example
        from onegpu.hyper import auto_table

        value = auto_table()["scratch"].get(key.rpartition(".")[2])
    if value is None or isinstance(value, (bool, str)):
        return {"an integer": "8", "a number": "0.5"}.get(kind, "...")
    return str(value)
