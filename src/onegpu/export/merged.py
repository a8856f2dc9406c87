"""`--format safetensors`: the merged model as transformers writes a Hub model (config, generation
config, safetensors weights, tokenizer with its chat template), with none of PEFT's files and none
of the switches a onegpu run sets on the config for training."""

from __future__ import annotations

import json
from pathlib import Path

from onegpu.models import save_tokenizer

# What a run sets on the config for training that a deployed model must not keep: checkpointing
# turns the KV cache off, the MoE router loss asks for router logits at every forward.
TRAINING_ONLY = {"use_cache": True, "output_router_logits": False}
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def write_safetensors(model, tokenizer, out: Path) -> Path:
    """``model``: a plain transformers model (adapters already merged)."""
    for key, value in TRAINING_ONLY.items():
        if hasattr(model.config, key):
            setattr(model.config, key, value)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)  # with a SentencePiece model: llama.cpp's converter reads it
    _check_clean(out)
    return out


def _check_clean(out: Path) -> None:
    """The folder loads as a Hub model would: no adapter files, no PEFT keys in the weights."""
    left = [f for f in PEFT_FILES if (out / f).exists()]
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if left or "quantization_config" in config:
        raise RuntimeError(f"the merged export kept PEFT or quantization leftovers: {left}")
    from safetensors import safe_open

    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            bad = [k for k in f.keys() if "lora_" in k or "base_layer" in k]
        if bad:
            raise RuntimeError(f"{shard.name} holds PEFT weights after the merge: {bad[:3]}")
