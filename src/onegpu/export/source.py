"""What is exported: a run folder, a model folder or an adapter, resolved and loaded with the
adapter merged into a base in full precision (a QLoRA run's base is reloaded unquantized: folding
adapters into 4-bit weights would round them away)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from onegpu.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class Source:
    model_dir: str  # the base (or whole) model folder
    adapter: Optional[str]
    family: str  # config.json's model_type
    dtype: str  # what the export is written in: float32, float16 or bfloat16
    qlora: bool  # the run trained its adapter over a quantized base
    data_format: Optional[str]  # what onegpu trained it on, when known
    notes: list[str] = field(default_factory=list)


def resolve(name: str, adapter: Optional[str], dtype: str) -> Source:
    """Where the base and the adapter are, and what the export will be, checked before any load."""
    from onegpu.infer.loading import resolve_model, trained_format

    model_dir, own_adapter = resolve_model(name)
    if own_adapter and adapter:
        raise ConfigError(
            f"'{name}' is itself an adapter; --adapter {adapter} would be a second one.",
            hint="give the base model folder to --model, or drop --adapter",
        )
    adapter = own_adapter or adapter
    if adapter and not (Path(adapter) / "adapter_config.json").is_file():
        raise ModelError(
            f"adapter folder '{adapter}' has no adapter_config.json.",
            hint="point --adapter at a run's final/ or a PeftModel.save_pretrained folder",
        )
    config = _read_config(model_dir)
    if config.get("quantization_config"):
        raise ModelError(
            f"the base '{model_dir}' is stored quantized "
            f"({config['quantization_config'].get('quant_method', 'quantized')}); an export "
            "merges into full-precision weights.",
            hint="give the full-precision base model with --model",
        )
    qlora = bool(adapter) and _trained_on_quantized_base(Path(adapter))
    out_dtype = DTYPE_NAMES.get(dtype) or _own_dtype(config)
    src = Source(
        model_dir,
        adapter,
        str(config.get("model_type", "?")),
        out_dtype,
        qlora,
        trained_format(adapter or model_dir),
    )
    if qlora:
        src.notes.append(
            "QLoRA run: the adapter is merged into the base reloaded in full precision "
            f"({out_dtype}), never into its 4-bit weights"
        )
    return src


def load_merged(src: Source, trust_remote_code: bool = False):
    """(model, tokenizer): the base in float32 with the adapter merged, then cast to the export's
    dtype (merging in float32 rounds once, at the cast)."""
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir(src), trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src.model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot load the model in '{src.model_dir}': {str(exc).splitlines()[0]}",
            hint="point --model at a run folder, <run>/final or a save_pretrained folder",
        ) from None
    if src.adapter:
        model = apply_adapter(model, tokenizer, src)
    return model.to(getattr(torch, src.dtype)).eval(), tokenizer


def apply_adapter(model, tokenizer, src: Source):
    """The adapter on ``model`` (PEFT), merged. An adapter whose shapes or layers are not the
    base's was trained on another base: one error naming both."""
    from peft import PeftModel

    vocab = len(tokenizer)
    if (
        model.get_input_embeddings().num_embeddings < vocab
    ):  # a run sizes embeddings to its tokenizer
        model.resize_token_embeddings(vocab)
    try:
        peft_model = PeftModel.from_pretrained(model, src.adapter)
    except (RuntimeError, ValueError, KeyError) as exc:
        named = _adapter_base(Path(src.adapter))
        raise ModelError(
            f"adapter '{src.adapter}' does not fit the base '{src.model_dir}' (it was trained on "
            f"'{named}'): {_first_line(exc)}",
            hint="pass the base the adapter was trained on with --model",
        ) from None
    return peft_model.merge_and_unload()


def tokenizer_dir(src: Source) -> str:
    if src.adapter and any(
        (Path(src.adapter) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return src.adapter
    return src.model_dir


def _read_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelError(
            f"'{model_dir}' is not a model folder (no config.json).",
            hint="point --model at a run folder, <run>/final or a save_pretrained folder",
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelError(
            f"{path} line {exc.lineno}: not valid JSON ({exc.msg}).",
            hint="restore the model folder's config.json",
        ) from None


def _own_dtype(config: dict) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return name if name in DTYPE_NAMES.values() else "float32"


def _trained_on_quantized_base(adapter: Path) -> bool:
    """A onegpu run records techniques.lora.quantize_base in its config.yaml beside final/."""
    import yaml

    for path in (adapter / "config.yaml", adapter.parent / "config.yaml"):
        if path.is_file():
            try:
                cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError:
                return False
            lora = (
                ((cfg.get("techniques") or {}).get("lora") or {}) if isinstance(cfg, dict) else {}
            )
            return str(lora.get("quantize_base", "none")) != "none"
    return False


def _adapter_base(adapter: Path) -> str:
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "?"
    return str(cfg.get("base_model_name_or_path") or "?")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
