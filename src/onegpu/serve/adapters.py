"""PEFT (LoRA) adapters by name on one base model: ``--adapter NAME=DIR`` loads each into the same
PeftModel, and a request's ``model`` picks one (the base answers to its own name). An unknown name
is a 404, never the base model answering in the adapter's place."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from onegpu.errors import ConfigError, ModelError, UnavailableError
from onegpu.infer.requests import BASE

log = logging.getLogger(__name__)


def parse_adapters(specs: list[str]) -> dict[str, str]:
    """``["math=runs/m/final", ...]`` -> {"math": "runs/m/final"}, each checked."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        name, folder = name.strip(), folder.strip()
        if not sep or not name or not folder:
            raise ConfigError(
                f"--adapter '{spec}' is not NAME=DIR.",
                hint="write it as --adapter math=runs/math/final (one flag per adapter)",
            )
        if name in adapters:
            raise ConfigError(
                f"--adapter name '{name}' is given twice.", hint="give each adapter its own name"
            )
        if not (Path(folder).expanduser() / "adapter_config.json").is_file():
            raise ModelError(
                f"--adapter {name}={folder}: no adapter_config.json there.",
                hint="point it at a folder written by PeftModel.save_pretrained",
            )
        adapters[name] = str(Path(folder).expanduser())
    return adapters


def attach_adapters(model, adapters: dict[str, str]):
    """The base model with every adapter loaded under its name (the base's weights shared)."""
    if not adapters:
        return model
    try:
        from peft import PeftModel
    except ImportError:
        raise UnavailableError(
            "peft is not installed; it is needed to serve adapters.",
            hint="pip install 'onegpu[peft]'",
        ) from None
    names = iter(adapters.items())
    name, folder = next(names)
    peft_model = PeftModel.from_pretrained(model, folder, adapter_name=name)
    for name, folder in names:
        peft_model.load_adapter(folder, adapter_name=name)
    peft_model.eval()
    for name, folder in adapters.items():
        _log_adapter(name, folder)
    return peft_model


def _log_adapter(name: str, folder: str) -> None:
    base = json.loads((Path(folder) / "adapter_config.json").read_text()).get(
        "base_model_name_or_path"
    )
    log.info("adapter %s from %s (trained on %s)", name, folder, base or "an unnamed base")


@dataclass(frozen=True)
class ServedModels:
    """The names a request's ``model`` may take: the base's and each adapter's."""

    base: str
    adapters: tuple[str, ...] = ()

    def __post_init__(self):
        if self.base in self.adapters:
            raise ConfigError(
                f"--adapter name '{self.base}' is also the base model's name.",
                hint="rename the adapter, or pass --served_name for the base",
            )

    def names(self) -> list[str]:
        return [self.base, *self.adapters]

    def adapter_for(self, name: Optional[str]) -> Optional[str]:
        """The engine's adapter for a requested model name. The base is named too once adapters
        are loaded: a PeftModel applies its active adapter to a request that names none (until
        some request in the engine's life has named one), so the base gets PEFT's own name for
        "no adapter on this row". No name (vLLM lets ``model`` out) is the base."""
        if name is None or name == self.base:
            return BASE if self.adapters else None
        if name in self.adapters:
            return name
        from onegpu.serve.schemas import APIError

        raise APIError(
            404,
            f"model '{name}' is not served here. Served: {', '.join(self.names())}.",
            param="model",
            code="model_not_found",
        )
