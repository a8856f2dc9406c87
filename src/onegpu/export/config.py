"""What `onegpu export` takes (no torch here: the CLI's flags are built from it)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal, Optional

from onegpu.errors import ConfigError

FORMATS = ("safetensors", "gguf", "ollama")
# llama.cpp's names for what its converter writes (unquantized) and its quantizer makes
UNQUANTIZED = ("f16", "bf16", "f32")
QUANTS = (*UNQUANTIZED, "q8_0", "q6_k", "q5_k_m", "q4_k_m")


@dataclass
class ExportConfig:
    """Export a trained model for another runtime, and check it there against onegpu's engine."""

    model: str = ""
    """A onegpu run folder (its final/ model), a save_pretrained folder, or a LoRA adapter folder
    (its base is loaded in full precision and the adapter merged)."""
    adapter: Optional[str] = None
    """A LoRA adapter folder to merge into --model."""
    output: str = ""
    """The folder to write: one subfolder per format (safetensors/, gguf/, ollama/). Default:
    <model>-export beside the model."""
    format: str = "safetensors"
    """What to write, comma-separated: safetensors (merged 16-bit, for transformers, vLLM,
    SGLang), gguf (llama.cpp), ollama (a GGUF and a Modelfile)."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """safetensors: the weights' dtype. auto: the model's own (config.json's dtype)."""
    quant: str = "q8_0"
    """gguf/ollama: f16, bf16, f32 (unquantized), q8_0, q6_k, q5_k_m, q4_k_m (llama.cpp's
    quantizer)."""
    check: Literal["on", "off"] = "on"
    """Load the export in its runtime and compare it with onegpu's engine on the source model."""
    check_tokens: int = 64
    """Greedy tokens compared per prompt (unquantized formats)."""
    prompts: list[str] = field(default_factory=list)
    """Prompts for the check (default: a run folder's first validation records, rendered as
    training rendered them; else built-in ones). export-check.json says which."""
    force: bool = False
    """Replace an existing output folder."""
    trust_remote_code: bool = False
    """Allow model code from the model folder to run."""

    def formats(self) -> list[str]:
        names = [f.strip() for f in self.format.split(",") if f.strip()]
        if not names:
            raise ConfigError("--format is empty.", hint=f"choose from: {', '.join(FORMATS)}")
        for name in names:
            if name not in FORMATS:
                raise ConfigError(f"unknown export format '{name}'.", hint=_choose(name, FORMATS))
        return list(dict.fromkeys(names))

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("no model given.", hint="onegpu export RUN_OR_MODEL_DIR --format ...")
        formats = self.formats()
        if self.quant not in QUANTS and {"gguf", "ollama"} & set(formats):
            raise ConfigError(
                f"unknown quant type '{self.quant}'.", hint=_choose(self.quant, QUANTS)
            )
        if self.check_tokens < 1:
            raise ConfigError("--check_tokens must be at least 1.", hint="e.g. --check_tokens 64")


def _choose(name: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name.lower(), choices, n=1)
    listed = f"choose one of: {', '.join(choices)}"
    return f"did you mean '{close[0]}'? ({listed})" if close else listed
