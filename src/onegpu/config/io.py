"""Configuration in and out: nested dicts and YAML files to typed dataclasses (unknown keys and
wrong types rejected with the field named), and back, with access tokens redacted."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from onegpu.config.names import suggest_key
from onegpu.config.sections import Config
from onegpu.errors import ConfigError


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass from a nested dict, rejecting unknown keys with a did-you-mean."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}.")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            # a close name at this level first (a section's own typo), else what the command
            # line suggests for the same flag: names from other trainers, a field in another section
            close = difflib.get_close_matches(str(key), names, n=1)
            meant = f"{prefix}{close[0]}" if close else suggest_key(where, cls, prefix)
            hint = f"did you mean '{meant}'?" if meant else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{where}'.", hint=hint)
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(value or {}, tp, where + ".")
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = (
                f"did you mean '{close[0]}'?"
                if close
                else f"choose one of: {', '.join(map(str, args))}"
            )
            raise ConfigError(f"{where}: invalid value '{value}'.", hint=hint)
        return value
    if (
        origin is Union and type(None) not in args
    ):  # a number or "auto": the first member that takes it
        for member in args:
            try:
                return _coerce(value, member, where)
            except ConfigError:
                pass
        raise ConfigError(
            f"{where} must be a number or 'auto', got {value!r}.", hint=f"set {where} to e.g. auto"
        )
    if args and type(None) in args:  # Optional[X]
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(
                f"{where} must be true or false, got {value!r}.",
                hint=f"set {where} to true or false",
            )
        return value
    if tp in (int, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (tp is int and value != int(value))
        ):
            raise ConfigError(
                f"{where} must be {'an integer' if tp is int else 'a number'}, got {value!r}.",
                hint=f"write {where} as a plain number, without quotes",
            )
        return tp(value)
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}.")
    return value


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", hint="check the path given to --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(
            f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)}).",
            hint="check the indentation and brackets at that line",
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (model, data, training, ...).",
            hint="start the file with a section, e.g. 'training:' then indented keys",
        )
    return data


def save_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False), encoding="utf-8")


SECRET_PATTERN = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,})"
)


def redact(data: Any) -> Any:
    """A copy of a config dict with access tokens blanked, so saved configs and logs never leak
    them: values that look like tokens, and the values of any *TOKEN*/*SECRET*/*KEY* environment
    variable."""
    import os

    secrets = [
        v
        for k, v in os.environ.items()
        if len(v) >= 8 and re.search(r"TOKEN|SECRET|PASSWORD|API_?KEY", k)
    ]

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, str):
            for s in secrets:
                v = v.replace(s, "<redacted>")
            return SECRET_PATTERN.sub("<redacted>", v)
        return v

    return clean(data)
