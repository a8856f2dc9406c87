"""Low-rank adapters (LoRA, DoRA) with PEFT, optionally over a bitsandbytes-quantized base (QLoRA).

The base stays frozen; only the adapter matrices (and DoRA's magnitude vectors) train, so gradients
and optimizer state shrink to a few percent of the model. Adapters are saved in PEFT's own format
(adapter_config.json + adapter_model.safetensors) and load with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from onegpu.config import ModelConfig, TechniquesConfig
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"bf16": "bfloat16", "bf16-pure": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _peft():
    try:
        import peft
    except ImportError:
        raise UnavailableError(
            "techniques.lora needs the peft library, which is not installed.",
            hint="pip install 'onegpu[peft]'",
        ) from None
    return peft


def quantization_config(tcfg: TechniquesConfig, precision: str, model_name: str, mcfg: ModelConfig):
    """The BitsAndBytesConfig to load the frozen base with (QLoRA), or None.

    Checked before loading: a quantized base can only be trained through adapters, and only
    pretrained weights are worth quantizing (a from-scratch model has nothing to preserve).
    """
    lcfg = tcfg.lora
    if lcfg.quantize_base == "none":
        return None
    if not lcfg.enabled:
        raise ConfigError(
            f"techniques.lora.quantize_base={lcfg.quantize_base} needs "
            "techniques.lora.enabled=true.",
            hint="a quantized base is frozen, so only adapters can train: enable LoRA",
        )
    from onegpu.models import is_preset

    if is_preset(model_name) or mcfg.from_scratch:
        raise ConfigError(
            f"techniques.lora.quantize_base={lcfg.quantize_base} needs pretrained weights, "
            f"but model '{model_name}' is built from scratch.",
            hint="set --model.name to a local model directory or Hub id (QLoRA fine-tunes a "
            "trained model)",
        )
    import torch

    from onegpu.techniques.quantization import bnb_config

    return bnb_config(
        lcfg.quantize_base,
        getattr(torch, COMPUTE_DTYPES.get(precision, "float32")),
        setting=f"techniques.lora.quantize_base={lcfg.quantize_base}",
        instead="or set techniques.lora.quantize_base=none",
    )


def apply_lora(model, tcfg: TechniquesConfig):
    """Wrap the model in a PeftModel with adapters on the configured linear layers."""
    lcfg = tcfg.lora
    if not lcfg.enabled:
        return model
    from onegpu.techniques.vision import lora_targets, no_gradient_to_pixels

    peft = _peft()
    # a vision-language model: the LM's layers (and the tower's with techniques.vision=all)
    targets, save = lora_targets(model, resolve_targets(model, lcfg.targets), tcfg.vision)
    if loaded_in_kbit(model):
        _warn_if_nothing_quantized(model, lcfg.quantize_base)
        # Freezes the base and upcasts any fp16/bf16 leftovers (norms, embeddings) to fp32 for
        # stable training; checkpointing is applied later by techniques.checkpointing.
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = peft.LoraConfig(
        r=lcfg.r,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=targets,
        use_dora=lcfg.dora,
        bias="none",
        modules_to_save=save,  # a vision-language model's projector, when it trains
        # a reward model's score head is new: PEFT trains it whole (modules_to_save), as TRL asks
        task_type="SEQ_CLS" if is_score_model(model) else "CAUSAL_LM",
    )
    dtype = adapter_dtype(lcfg.dtype, tcfg.precision)
    # PEFT creates adapters in the base layer's dtype and then upcasts 16-bit ones to fp32
    # (autocast_adapter_dtype); for bf16 adapters we skip that and cast them ourselves, since an
    # fp32 base (autocast precisions) would otherwise give fp32 adapters.
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=dtype == "fp32")
    _cast_trainable(model, dtype)
    if tcfg.checkpointing != "off":
        # Only reentrant checkpointing needs inputs that require grad (peft#1142); we use the
        # non-reentrant one, but this keeps a model checkpointed elsewhere from silently losing
        # grads. A vision-language model's tower gets none (vision.no_gradient_to_pixels).
        model.enable_input_require_grads()
        no_gradient_to_pixels(model)
    trainable, total = model.get_nb_trainable_parameters()
    log.info(
        "%s %s adapters (r=%d) on %s layers of a%s base; %d of %d parameters train (%.2f%%)",
        dtype,
        "DoRA" if lcfg.dora else "LoRA",
        lcfg.r,
        targets if isinstance(targets, str) or len(targets) < 8 else f"{len(targets)} named",
        "n " + lcfg.quantize_base if loaded_in_kbit(model) else " full-precision",
        trainable,
        total,
        100 * trainable / max(total, 1),
    )
    return model


def adapter_dtype(dtype: str, precision: str) -> str:
    """lora.dtype settled for a precision: "fp32" or "bf16" (training and the planner both ask
    here).

    auto = bf16 only under bf16-pure, where the user has chosen bf16 weights for the whole model
    (torchtune's LoRA recipes train adapters in bf16 the same way); under autocast the adapters are
    the trained master weights, kept in fp32 as PEFT does, since bf16 updates below its 8-bit
    mantissa's resolution would be lost."""
    if dtype == "bf16" and precision == "fp16":
        raise ConfigError(
            "techniques.lora.dtype=bf16 with precision=fp16: adapters would be bf16 while the "
            "model computes in fp16.",
            hint="use techniques.lora.dtype=fp32 (or auto) with fp16",
        )
    if dtype == "auto":
        return "bf16" if precision == "bf16-pure" else "fp32"
    return dtype


def _cast_trainable(model, dtype: str) -> None:
    """Put every trainable tensor (adapters, DoRA magnitudes) in the chosen dtype; the frozen base
    keeps its own."""
    import torch

    want = torch.bfloat16 if dtype == "bf16" else torch.float32
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)


def is_score_model(model) -> bool:
    """A sequence-classification model (a reward model's score head), not a causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    return type(model).__name__ in set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values())


def resolve_targets(model, spec: str):
    """ "all-linear" (every linear layer but the output head, as PEFT defines it) or a checked list
    of names; a name that matches nothing is an error, not a run that silently trains nothing."""
    if spec.strip() == "all-linear":
        return "all-linear"
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    names = linear_module_names(model)
    missing = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in names)]
    if not wanted or missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(
            f"techniques.lora.targets: {', '.join(missing) or repr(spec)} matches no linear layer "
            "of this model.",
            hint=f"use all-linear, or names from: {', '.join(short)}",
        )
    return wanted


def linear_module_names(model) -> list[str]:
    import torch
    from transformers.pytorch_utils import Conv1D  # GPT-2 style linear layers

    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def loaded_in_kbit(model) -> bool:
    """True for a model transformers loaded with a bitsandbytes 4- or 8-bit quantization config
    (QLoRA's base); the flags are the ones PEFT's prepare_model_for_kbit_training reads."""
    return bool(
        getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    )


def _warn_if_nothing_quantized(model, kind: str) -> None:
    """transformers swaps only layers whose type is exactly nn.Linear (or GPT-2's Conv1D) for
    bitsandbytes ones; a model with its own Linear subclass (Falcon's FalconLinear) loads with the
    flag set and every weight still full precision: say so rather than let the memory saving be
    assumed."""
    if not any(type(m).__module__.startswith("bitsandbytes") for m in model.modules()):
        log.warning(
            "techniques.lora.quantize_base=%s: no layer of %s was quantized (its linear layers are "
            "not plain nn.Linear, which is all transformers quantizes); the base stays full "
            "precision",
            kind,
            type(model).__name__,
        )


def save_merged(model, out_dir: Path, base_name: str, mcfg: ModelConfig) -> Path:
    """Write a plain transformers model with the adapters folded into the weights.

    Unquantized: merged in place (the function computed is unchanged, so the in-memory model still
    gives the same outputs). Quantized: the base is reloaded unquantized from ``base_name`` and the
    adapters merged there, since folding them into 4/8-bit weights would round them away.
    """
    if not hasattr(model, "merge_and_unload"):
        raise ConfigError(
            "techniques.lora.merge_on_save needs a model with LoRA adapters.",
            hint="enable techniques.lora, or turn merge_on_save off",
        )
    if loaded_in_kbit(model):
        merged = _merge_into_full_precision(model, base_name, mcfg)
    else:
        merged = model.merge_and_unload()
    merged.save_pretrained(str(out_dir), safe_serialization=True)
    log.info("merged model written to %s", out_dir)
    return Path(out_dir)


def _merge_into_full_precision(model, base_name: str, mcfg: ModelConfig):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        base_name, dtype="auto", trust_remote_code=mcfg.trust_remote_code
    )
    vocab = model.get_input_embeddings().num_embeddings
    if base.get_input_embeddings().num_embeddings != vocab:
        base.resize_token_embeddings(vocab)
    peft = _peft()
    full = peft.get_peft_model(base, copy.deepcopy(model.peft_config["default"]))
    set_peft_model_state_dict(
        full, {k: v.to("cpu") for k, v in get_peft_model_state_dict(model).items()}
    )
    return full.merge_and_unload()
