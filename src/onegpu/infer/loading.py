"""Inference loading: a causal LM (a onegpu run, any save_pretrained directory, a PEFT adapter, a
Hub id) in the chosen dtype, attention kernel and quantization.

Loading order: weights (bitsandbytes quantizes while loading) -> device -> LoRA adapter (applied or
merged) -> torchao (quantizes the merged weights in place, so a merged adapter is quantized too).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from onegpu.errors import ConfigError, ModelError, UnavailableError
from onegpu.techniques.quantization import BNB_KINDS, TORCHAO_KINDS

log = logging.getLogger(__name__)

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class InferConfig:
    model: str = ""
    """A onegpu run directory (its final/ model is used), a save_pretrained directory, a PEFT
    adapter directory (its base model is loaded first), or a Hugging Face model id."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or id. Default: the model's (or the adapter's) own."""
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """Weight and compute dtype. auto = bf16 on Ampere+ GPUs, fp16 on older GPUs, fp32 on CPU."""
    attention: Literal["auto", "eager", "sdpa", "flash"] = "auto"
    """Attention kernel. auto = the fastest the model and device support (training's rule:
    flash_attention_2 with flash_attn on a GPU in fp16/bf16, else sdpa, PyTorch's fused
    scaled_dot_product_attention, else eager); flash needs a CUDA GPU and fp16/bf16."""
    quantization: Literal["none", "int8", "nf4", "fp4", "ao-int8", "ao-int8-dynamic", "ao-int4"] = (
        "none"
    )
    """Weight quantization. int8 = bitsandbytes LLM.int8(); nf4/fp4 = bitsandbytes 4-bit — these
    save memory and decode SLOWER than bf16 (0.2-0.7x). ao-int8 = torchao int8 weight-only, ao-int4
    = torchao int4 weight-only (CUDA only): the fast path on a GPU with the compiled engine;
    ao-int8-dynamic = torchao int8 weights and activations."""
    int8_threshold: float = 6.0
    """LLM.int8() outlier threshold: activation features above it stay in 16-bit."""
    double_quant: bool = True
    """4-bit: also quantize the quantization scales (saves ~0.4 bit per weight)."""
    compute_dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """4-bit: dtype the matmuls run in (auto = the model dtype)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs (auto = cuda when present). Ignored when device_map is set."""
    device_map: Optional[str] = None
    """Weight placement by Accelerate, e.g. "auto": fill the GPU, then CPU RAM, then offload_folder.
    """
    max_memory: Optional[str] = None
    """With device_map: memory budget per device, e.g. "0=6GiB,cpu=24GiB" (layers beyond it spill
    over)."""
    offload_folder: Optional[str] = None
    """With device_map: folder for weights that fit neither the GPU nor the CPU budget."""
    adapter: Optional[str] = None
    """PEFT (LoRA) adapter directory to apply on top of the model."""
    merge_adapter: bool = False
    """Merge the adapter into the weights (faster generation; the adapter cannot be removed)."""
    trust_remote_code: bool = False
    """Allow model code from the model repository to run."""


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    device: str
    dtype: Any
    source: str  # the model directory or id actually loaded
    data_format: Optional[str] = (
        None  # what onegpu trained it on (text | prompt_completion | messages), if known
    )
    processor: Any = None  # a vision-language model's processor (its tokenizer is ``tokenizer``)


def resolve_model(name: str) -> tuple[str, Optional[str]]:
    """Map what the user named to (model dir or Hub id, adapter dir or None)."""
    if not name:
        raise ConfigError("no model given.", hint="pass --model <run dir | model dir | Hub id>")
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "final").is_dir():  # a onegpu run directory
            path = path / "final"
        if (path / "config.json").is_file():
            return str(path), None
        if (path / "adapter_config.json").is_file():
            return _adapter_base(path), str(path)
        raise ModelError(
            f"'{name}' has neither config.json nor adapter_config.json.",
            hint="point --model at <run>/final or a folder written by save_pretrained",
        )
    if name.startswith((".", "/", "~")) or path.exists():
        raise ModelError(
            f"model directory '{name}' does not exist.",
            hint="check the path (a run dir or <run>/final)",
        )
    return name, None  # a Hub id


def _adapter_base(adapter_dir: Path) -> str:
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get(
        "base_model_name_or_path"
    )
    if not base:
        raise ModelError(
            f"adapter {adapter_dir} does not name its base model.",
            hint=f"pass --model <base model dir> --adapter {adapter_dir}",
        )
    return base


def load(cfg: InferConfig) -> Loaded:
    from onegpu.models import is_vision_model

    source, adapter = resolve_model(cfg.model)
    vision = is_vision_model(source, cfg.trust_remote_code)
    if adapter and cfg.adapter:
        raise ConfigError(
            f"--model {cfg.model} is itself an adapter; --adapter {cfg.adapter} would be a second "
            "one.",
            hint="give the base model to --model, or drop --adapter",
        )
    adapter = adapter or cfg.adapter
    device = _resolve_device(cfg.device)
    dtype = _resolve_dtype(cfg.dtype, device)
    processor = None
    if vision:  # its processor: the image rules and the tokenizer together (onegpu.vlm)
        processor = _load_processor(cfg.tokenizer or source, cfg.trust_remote_code)
        tokenizer = processor.tokenizer
    else:
        tokenizer = _load_tokenizer(
            cfg.tokenizer or _tokenizer_source(source, adapter), cfg.trust_remote_code
        )
    model = _from_pretrained(source, cfg, device, dtype, vision)
    if adapter:
        model = _apply_adapter(model, adapter, cfg.merge_adapter)
    if cfg.quantization in TORCHAO_KINDS:
        from onegpu.techniques.quantization import apply_torchao

        apply_torchao(model, cfg.quantization, device, dtype)
    model.eval()  # generation runs under inference_mode; grad mode is left to the caller
    log.info(
        "loaded %s (%s, %s, attention=%s, quantization=%s)",
        source,
        device,
        dtype,
        model.config._attn_implementation,
        cfg.quantization,
    )
    fmt = trained_format(adapter or source)
    return Loaded(model, tokenizer, device, dtype, source, fmt, processor)


def trained_format(model_dir: str) -> Optional[str]:
    """The data format a onegpu run trained this model on, from the run's config.yaml next to its
    final/ (or checkpoint) folder: `generate` uses it to decide whether prompts are chat turns.
    None for any other model, or a run that recorded no detected format."""
    import yaml

    path = Path(model_dir).expanduser()
    if not path.is_dir():  # a Hub id
        return None
    for candidate in (path / "config.yaml", path.parent / "config.yaml"):
        if candidate.is_file():
            try:
                data = (yaml.safe_load(candidate.read_text(encoding="utf-8")) or {}).get(
                    "data"
                ) or {}
            except (
                yaml.YAMLError,
                AttributeError,
            ):  # not a onegpu config: nothing to learn from it
                return None
            fmt = data.get("format") if isinstance(data, dict) else None
            return fmt if fmt in ("text", "prompt_completion", "messages", "preference") else None
    return None


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UnavailableError(
            "--device cuda was asked for, but no CUDA GPU is visible.", hint="use --device cpu"
        )
    return device


def _resolve_dtype(name: str, device: str, field: str = "dtype"):
    import torch

    from onegpu.hardware import detect

    # bf16 on a GPU: native from Ampere (capability 8.0), the rule training uses
    # (hardware.DeviceInfo.bf16); torch.cuda.is_bf16_supported() also says yes where bf16 is only
    # emulated (T4, V100), and slow.
    gpu = detect() if device == "cuda" else None
    if name == "auto":
        if gpu is None:
            return torch.float32  # bf16/fp16 matmuls are 10-40x slower than fp32 on most CPUs
        return torch.bfloat16 if gpu.bf16 else torch.float16
    if name == "bf16" and gpu is not None and not gpu.bf16:
        cap = ".".join(map(str, gpu.capability or ()))
        raise UnavailableError(
            f"--{field} bf16: {gpu.name} (compute capability {cap}) has no native bf16; "
            "it needs an Ampere or newer GPU (capability 8.0+).",
            hint=f"use --{field} fp16",
        )
    return getattr(torch, DTYPES[name])


def _tokenizer_source(source: str, adapter: Optional[str]) -> str:
    """An adapter folder written by a fine-tuning run carries the tokenizer it was trained with."""
    if adapter and any(
        (Path(adapter) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return adapter
    return source


def _load_processor(source: str, trust_remote_code: bool):
    from onegpu import vlm
    from onegpu.models import model_config

    vlm.check_family(model_config(source, trust_remote_code))
    return vlm.load_processor(source, trust_remote_code)


def _load_tokenizer(name: str, trust_remote_code: bool):
    from onegpu.models import load_tokenizer

    return load_tokenizer(name, trust_remote_code)


def _from_pretrained(source: str, cfg: InferConfig, device: str, dtype, vision: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        attn_implementation=_attention(cfg.attention, device, dtype, source, cfg.trust_remote_code),
        trust_remote_code=cfg.trust_remote_code,
    )
    if cfg.quantization in BNB_KINDS:
        from onegpu.techniques.quantization import bnb_config, quiet_int8_cast_warning

        compute = (
            dtype
            if cfg.compute_dtype == "auto"
            else _resolve_dtype(cfg.compute_dtype, device, "compute_dtype")
        )
        kwargs["quantization_config"] = bnb_config(
            cfg.quantization, compute, cfg.double_quant, cfg.int8_threshold
        )
        quiet_int8_cast_warning()
        if device == "cuda" and not cfg.device_map:
            kwargs["device_map"] = {"": 0}  # bitsandbytes quantizes while placing the weights
    if cfg.device_map:
        kwargs.update(
            device_map=cfg.device_map,
            max_memory=parse_max_memory(cfg.max_memory),
            offload_folder=cfg.offload_folder,
        )
    elif cfg.max_memory or cfg.offload_folder:
        log.warning("max_memory/offload_folder only apply with --device_map (e.g. auto); ignored")
    try:
        cls = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = cls.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        from onegpu.models import _first_line

        raise ModelError(
            f"cannot load model '{source}': {_first_line(exc)}",
            hint="give a run directory, a save_pretrained folder, or a Hub id while online",
        ) from None
    if "device_map" not in kwargs:
        model.to(device)
    return model


def _attention(
    choice: str, device: str, dtype, source: Optional[str] = None, trust_remote_code: bool = False
) -> str:
    """Training's attention resolution (techniques/attention.py) for the model at ``source``, after
    the checks that make an explicit "flash" an error here rather than a fallback: inference has no
    run to keep going."""
    import torch

    from onegpu.models import model_config
    from onegpu.techniques.attention import attention_implementation, model_kernels

    if choice == "flash":
        if device != "cuda":
            raise UnavailableError(
                "flash attention needs a CUDA GPU.",
                hint="use --attention auto on CPU (the default)",
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(
                f"flash attention runs in fp16/bf16 only, not {dtype}.", hint="add --dtype bf16"
            )
    kernels = None
    if source:
        try:
            kernels = model_kernels(model_config(source, trust_remote_code), trust_remote_code)
        except ModelError:
            pass  # from_pretrained reports it, with inference's own advice
    return attention_implementation(
        choice, device, model=kernels, half=dtype in (torch.float16, torch.bfloat16)
    )


def parse_max_memory(text: Optional[str]) -> Optional[dict]:
    """'0=6GiB,cpu=24GiB' -> {0: '6GiB', 'cpu': '24GiB'} (GPU indices as ints, as Accelerate wants;
    a bare number is bytes)."""
    if not text:
        return None
    budget: dict = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not value.strip():
            raise ConfigError(
                f"max_memory: cannot read '{part}'.", hint='write it as "0=6GiB,cpu=24GiB"'
            )
        key, value = key.strip().removeprefix("cuda:"), value.strip()
        budget[int(key) if key.isdigit() else key] = (
            int(value) if value.isdigit() else value
        )  # bare = bytes
    return budget


def _apply_adapter(model, adapter: str, merge: bool):
    try:
        from peft import PeftModel
    except ImportError:
        raise UnavailableError(
            "peft is not installed; it is needed to apply an adapter.",
            hint="pip install 'onegpu[peft]'",
        ) from None
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ModelError(
            f"adapter directory '{adapter}' has no adapter_config.json.",
            hint="point --adapter at a folder written by PeftModel.save_pretrained",
        )
    model = PeftModel.from_pretrained(model, adapter)
    return model.merge_and_unload() if merge else model
