"""Inference: load a causal LM (a onegpu run, any save_pretrained directory, a PEFT adapter, a Hub
id) in the chosen dtype, attention kernel and quantization, and generate from batches of prompts.

Loading order: weights (bitsandbytes quantizes while loading) -> device -> LoRA adapter (applied or
merged) -> torchao (quantizes the merged weights in place, so a merged adapter is quantized too).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from onegpu.errors import ConfigError, DataError, ModelError, UnavailableError
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
    """Attention kernel. sdpa (= auto) is PyTorch's fused scaled_dot_product_attention, the native
    successor of BetterTransformer's fast path; flash needs a CUDA GPU and fp16/bf16."""
    quantization: Literal["none", "int8", "nf4", "fp4", "ao-int8", "ao-int8-dynamic", "ao-int4"] = "none"
    """Weight quantization. int8 = bitsandbytes LLM.int8(); nf4/fp4 = bitsandbytes 4-bit;
    ao-int8 = torchao int8 weight-only; ao-int8-dynamic = torchao int8 weights and activations;
    ao-int4 = torchao int4 weight-only (CUDA only)."""
    int8_threshold: float = 6.0
    """LLM.int8() outlier threshold: activation features above it stay in 16-bit."""
    double_quant: bool = True
    """4-bit: also quantize the quantization scales (saves ~0.4 bit per weight)."""
    compute_dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """4-bit: dtype the matmuls run in (auto = the model dtype)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs (auto = cuda when present). Ignored when device_map is set."""
    device_map: Optional[str] = None
    """Weight placement by Accelerate, e.g. "auto": fill the GPU, then CPU RAM, then offload_folder."""
    max_memory: Optional[str] = None
    """With device_map: memory budget per device, e.g. "0=6GiB,cpu=24GiB" (layers beyond it spill over)."""
    offload_folder: Optional[str] = None
    """With device_map: folder for weights that fit neither the GPU nor the CPU budget."""
    adapter: Optional[str] = None
    """PEFT (LoRA) adapter directory to apply on top of the model."""
    merge_adapter: bool = False
    """Merge the adapter into the weights (faster generation; the adapter cannot be removed)."""
    trust_remote_code: bool = False
    """Allow model code from the model repository to run."""


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    """Tokens to generate per prompt at most."""
    greedy: bool = False
    """Always pick the most likely token (deterministic). Same as temperature 0."""
    temperature: float = 0.8
    """Sampling temperature (0 = greedy)."""
    top_p: float = 0.95
    """Nucleus sampling: sample from the smallest token set with this total probability (1 = off)."""
    top_k: int = 50
    """Sample from the k most likely tokens only (0 = off)."""
    repetition_penalty: float = 1.0
    """Divide the scores of already generated tokens by this (1 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop a sequence when it produces any of these strings (cut from the output)."""
    batch_size: int = 8
    """Prompts generated together (left padded)."""
    seed: int = 1234
    """Seed for sampling; the same seed and prompts give the same output."""
    static_cache: bool = False
    """Preallocate the KV cache to its final size, so every decode step has the same shapes."""
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    """torch.compile the decode step (implies static_cache; the first call pays for compilation)."""
    compile_backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    device: str
    dtype: Any
    source: str  # the model directory or id actually loaded


@dataclass
class Completion:
    prompt: str
    text: str
    new_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


# ----------------------------------------------------------------------------------------- loading

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
        raise ModelError(f"'{name}' has neither config.json nor adapter_config.json.",
                         hint="point --model at <run>/final or a folder written by save_pretrained")
    if name.startswith((".", "/", "~")) or path.exists():
        raise ModelError(f"model directory '{name}' does not exist.", hint="check the path (a run dir or <run>/final)")
    return name, None  # a Hub id


def _adapter_base(adapter_dir: Path) -> str:
    base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelError(f"adapter {adapter_dir} does not name its base model.",
                         hint=f"pass --model <base model dir> --adapter {adapter_dir}")
    return base


def load(cfg: InferConfig) -> Loaded:
    source, adapter = resolve_model(cfg.model)
    if adapter and cfg.adapter:
        raise ConfigError(f"--model {cfg.model} is itself an adapter; --adapter {cfg.adapter} would be a second one.",
                          hint="give the base model to --model, or drop --adapter")
    adapter = adapter or cfg.adapter
    device = _resolve_device(cfg.device)
    dtype = _resolve_dtype(cfg.dtype, device)
    tokenizer = _load_tokenizer(cfg.tokenizer or _tokenizer_source(source, adapter), cfg.trust_remote_code)
    model = _from_pretrained(source, cfg, device, dtype)
    if adapter:
        model = _apply_adapter(model, adapter, cfg.merge_adapter)
    if cfg.quantization in TORCHAO_KINDS:
        from onegpu.techniques.quantization import apply_torchao

        apply_torchao(model, cfg.quantization, device, dtype)
    model.eval()  # generation runs under inference_mode; grad mode is left to the caller
    log.info("loaded %s (%s, %s, attention=%s, quantization=%s)", source, device, dtype,
             model.config._attn_implementation, cfg.quantization)
    return Loaded(model, tokenizer, device, dtype, source)


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UnavailableError("--device cuda was asked for, but no CUDA GPU is visible.", hint="use --device cpu")
    return device


def _resolve_dtype(name: str, device: str):
    import torch

    if name == "auto":
        if device != "cuda":
            return torch.float32  # bf16/fp16 matmuls are 10-40x slower than fp32 on most CPUs
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, DTYPES[name])


def _tokenizer_source(source: str, adapter: Optional[str]) -> str:
    """An adapter folder written by a fine-tuning run carries the tokenizer it was trained with."""
    if adapter and any((Path(adapter) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return adapter
    return source


def _load_tokenizer(name: str, trust_remote_code: bool):
    from onegpu.models import load_tokenizer

    return load_tokenizer(name, trust_remote_code)


def _from_pretrained(source: str, cfg: InferConfig, device: str, dtype):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=_attention(cfg.attention, device, dtype),
                                  trust_remote_code=cfg.trust_remote_code)
    if cfg.quantization in BNB_KINDS:
        from onegpu.techniques.quantization import bnb_config, quiet_int8_cast_warning

        compute = dtype if cfg.compute_dtype == "auto" else _resolve_dtype(cfg.compute_dtype, device)
        kwargs["quantization_config"] = bnb_config(cfg.quantization, compute, cfg.double_quant, cfg.int8_threshold)
        quiet_int8_cast_warning()
        if device == "cuda" and not cfg.device_map:
            kwargs["device_map"] = {"": 0}  # bitsandbytes quantizes while placing the weights
    if cfg.device_map:
        kwargs.update(device_map=cfg.device_map, max_memory=parse_max_memory(cfg.max_memory),
                      offload_folder=cfg.offload_folder)
    elif cfg.max_memory or cfg.offload_folder:
        log.warning("max_memory/offload_folder only apply with --device_map (e.g. auto); ignored")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        from onegpu.models import _first_line

        raise ModelError(f"cannot load model '{source}': {_first_line(exc)}",
                         hint="give a run directory, a save_pretrained folder, or a Hub id while online") from None
    if "device_map" not in kwargs:
        model.to(device)
    return model


def _attention(choice: str, device: str, dtype) -> str:
    import importlib.util

    import torch

    if choice in ("auto", "sdpa"):
        return "sdpa"
    if choice == "eager":
        return "eager"
    if device != "cuda":
        raise UnavailableError("flash attention needs a CUDA GPU.", hint="use --attention sdpa on CPU (the default)")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"flash attention runs in fp16/bf16 only, not {dtype}.", hint="add --dtype bf16")
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    log.info("flash_attn is not installed: using PyTorch SDPA, which dispatches to its own FlashAttention kernel")
    return "sdpa"


def parse_max_memory(text: Optional[str]) -> Optional[dict]:
    """'0=6GiB,cpu=24GiB' -> {0: '6GiB', 'cpu': '24GiB'} (GPU indices as ints, as Accelerate wants;
    a bare number is bytes)."""
    if not text:
        return None
    budget: dict = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not value.strip():
            raise ConfigError(f"max_memory: cannot read '{part}'.", hint='write it as "0=6GiB,cpu=24GiB"')
        key, value = key.strip().removeprefix("cuda:"), value.strip()
        budget[int(key) if key.isdigit() else key] = int(value) if value.isdigit() else value  # bare = bytes
    return budget


def _apply_adapter(model, adapter: str, merge: bool):
    try:
        from peft import PeftModel
    except ImportError:
        raise UnavailableError("peft is not installed; it is needed to apply an adapter.",
                               hint="pip install 'onegpu[peft]'") from None
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ModelError(f"adapter directory '{adapter}' has no adapter_config.json.",
                         hint="point --adapter at a folder written by PeftModel.save_pretrained")
    model = PeftModel.from_pretrained(model, adapter)
    return model.merge_and_unload() if merge else model


# -------------------------------------------------------------------------------------- generation

def generate(model, tokenizer, prompts: list[str], scfg: SamplingConfig, streamer=None) -> list[Completion]:
    """Generate a completion per prompt, ``scfg.batch_size`` prompts at a time (left padded)."""
    from transformers import set_seed

    _check_sampling(scfg)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"prompt {i + 1} is empty.", hint="remove empty prompts (or blank lines in the prompt file)")
    set_seed(scfg.seed)
    done: list[Completion] = []
    for start in range(0, len(prompts), scfg.batch_size):
        done += _generate_batch(model, tokenizer, prompts[start:start + scfg.batch_size], scfg, streamer, start)
    return done


def _check_sampling(scfg: SamplingConfig) -> None:
    checks = {"max_new_tokens": scfg.max_new_tokens >= 1, "batch_size": scfg.batch_size >= 1,
              "temperature": scfg.temperature >= 0, "top_p": 0 < scfg.top_p <= 1, "top_k": scfg.top_k >= 0,
              "repetition_penalty": scfg.repetition_penalty > 0}
    for name, ok in checks.items():
        if not ok:
            raise ConfigError(f"--{name} has an invalid value: {getattr(scfg, name)}.",
                              hint="max_new_tokens, batch_size >= 1; temperature, top_k >= 0; 0 < top_p <= 1")
    if any(not s for s in scfg.stop):
        raise ConfigError("--stop contains an empty string.", hint="remove it; an empty stop string would stop at once")


def _generate_batch(model, tokenizer, prompts: list[str], scfg: SamplingConfig, streamer, offset: int):
    import torch

    context = _context_length(model)
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    for i, n in enumerate(lengths):
        if context and n >= context:
            raise DataError(f"prompt {offset + i + 1} is {n} tokens; the model's context is {context} tokens.",
                            hint=f"shorten the prompt to under {context} tokens")
    tokenizer.padding_side = "left"  # new tokens must follow each prompt directly
    multiple = _pad_multiple(scfg, max(lengths), context)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, pad_to_multiple_of=multiple).to(_input_device(model))
    width = enc["input_ids"].shape[1]
    max_new = scfg.max_new_tokens
    if context and width + max_new > context:
        max_new = context - width
        log.warning("max_new_tokens lowered from %d to %d to stay within the %d-token context",
                    scfg.max_new_tokens, max_new, context)
    with torch.inference_mode():
        out = model.generate(**enc, **generation_kwargs(model, tokenizer, scfg, max_new), streamer=streamer)
    return [_completion(p, row[width:], tokenizer, scfg.stop) for p, row in zip(prompts, out.tolist())]


def _pad_multiple(scfg: SamplingConfig, longest: int, context: Optional[int]) -> Optional[int]:
    """With a static cache + compile, pad prompts to a multiple of 64 tokens so that prompts of
    similar length share one compiled graph instead of recompiling for every length."""
    if not (scfg.static_cache or scfg.compile != "off"):
        return None
    padded = -(-longest // 64) * 64
    return 64 if context is None or padded + 1 < context else None


def _context_length(model) -> Optional[int]:
    return getattr(model.config, "max_position_embeddings", None)


def _input_device(model):
    """Inputs go where the embeddings are (the first device under a device_map; weights offloaded
    to disk sit on the meta device and are streamed in from CPU)."""
    device = model.get_input_embeddings().weight.device
    return "cpu" if device.type == "meta" else device


def generation_kwargs(model, tokenizer, scfg: SamplingConfig, max_new_tokens: int) -> dict:
    """Arguments for model.generate: sampling, stop strings, and the static-cache/compile path."""
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    sample = not scfg.greedy and scfg.temperature > 0
    kw["do_sample"] = sample
    if sample:
        kw.update(temperature=scfg.temperature, top_p=scfg.top_p, top_k=scfg.top_k)
    if scfg.repetition_penalty != 1.0:
        kw["repetition_penalty"] = scfg.repetition_penalty
    if scfg.stop:
        kw.update(stop_strings=list(scfg.stop), tokenizer=tokenizer)
    if scfg.static_cache or scfg.compile != "off":
        kw["cache_implementation"] = "static"
    if scfg.compile != "off":
        kw["compile_config"] = _compile_config(model, scfg)
    else:
        kw["disable_compile"] = True  # transformers would otherwise auto-compile static-cache decoding on GPUs
    return kw


def _compile_config(model, scfg: SamplingConfig):
    from transformers import CompileConfig

    mode = scfg.compile
    if model.device.type != "cuda" and mode == "reduce-overhead":
        mode = "default"  # reduce-overhead means CUDA graphs; there is nothing to capture elsewhere
    # dynamic=False: the static cache keeps decode shapes fixed, so one specialised graph serves all steps.
    cc = CompileConfig(backend=scfg.compile_backend, mode=mode, fullgraph=False, dynamic=False)
    # transformers compiles only on accelerators unless told; we compile where the user asked.
    cc._compile_all_devices = True
    return cc


def _completion(prompt: str, new_ids: list[int], tokenizer, stops: list[str]) -> Completion:
    eos = tokenizer.eos_token_id
    finish = "length"
    if eos is not None and eos in new_ids:
        new_ids = new_ids[:new_ids.index(eos) + 1]
        finish = "stop"
    elif tokenizer.pad_token_id is not None and tokenizer.pad_token_id in new_ids:
        # a sequence that hit a stop string is padded while the rest of its batch finishes
        new_ids = new_ids[:new_ids.index(tokenizer.pad_token_id)]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
    return Completion(prompt, text, len(new_ids), finish)
