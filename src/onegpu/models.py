"""Load a causal LM and its tokenizer: a built-in Llama preset, a Hub id, or a local directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from onegpu.config import ModelConfig
from onegpu.errors import ModelError

log = logging.getLogger(__name__)

# Llama-architecture presets. Sizes are without embeddings unless noted; vocab comes from the
# tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    ),
    "125m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    ),
    # Llama-3.2-3B's shape (its config.json: 28 layers, d=3072, GQA 24/8, head_dim 128), with the
    # presets' own vocabulary: the larger shape FP8's GPU check measures (bench_train.py gpu-fp8-3b)
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    ),
}


def resolve_name(cfg: ModelConfig, on_gpu: bool) -> str:
    """'auto' is a preset chosen by the device: tiny trains in minutes on a CPU, 125m suits a
    GPU."""
    if cfg.name == "auto":
        return "125m" if on_gpu else "tiny"
    return cfg.name


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, tokenizer, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        PRESETS[name],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=name in ("tiny", "small"),
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load a tokenizer and give it a pad token that is not EOS where we can (see
    ensure_pad_token)."""
    from transformers import AutoTokenizer

    local = _looks_local(name)
    if local and not Path(name).expanduser().is_dir():
        raise ModelError(
            f"tokenizer directory '{name}' does not exist.",
            hint="point model.tokenizer at a folder written by save_pretrained, or a Hub id",
        )
    if local:
        _check_tokenizer_files(Path(name).expanduser(), name)
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        hint = (
            "check that the folder holds a tokenizer written by save_pretrained"
            if local
            else "give a local directory, or a Hub id while online (HF_HUB_OFFLINE unset)"
        )
        raise ModelError(f"cannot load tokenizer '{name}': {_one_line(exc)}", hint=hint) from None
    return ensure_pad_token(tok)


# What AutoTokenizer builds a tokenizer from: a fast tokenizer's file, its config, or a slow
# tokenizer's vocabulary
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _check_tokenizer_files(folder: Path, name: str) -> None:
    """A local folder without any tokenizer file: say what is missing and what is there, rather
    than the tokenizer backend's account of the ways it tried to build one."""
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        return
    present = sorted(p.name for p in folder.iterdir())
    more = " ..." if len(present) > 8 else ""
    holds = f"it holds {', '.join(present[:8])}{more}" if present else "it is empty"
    config = "" if (folder / "config.json").is_file() else " and no config.json"
    files = " or ".join(TOKENIZER_FILES[:2])
    raise ModelError(
        f"'{name}' holds no tokenizer (no {files}){config}; {holds}.",
        hint="point --model.name (or --model.tokenizer) at a folder written by "
        "save_pretrained (e.g. <run>/final), or a Hub id",
    )


def ensure_pad_token(tok):
    """Padding is masked by position (labels=-100 where attention_mask is 0), never by token id, so
    a pad id equal to EOS would not hide EOS from the loss. We still prefer a distinct pad token so
    that collators elsewhere cannot fall into that trap (transformers#23530)."""
    if tok.pad_token is not None:
        return tok
    vocab = tok.get_vocab()
    for candidate in ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "[PAD]", "<|endoftext|>"):
        if candidate in vocab and candidate != tok.eos_token:
            tok.pad_token = candidate
            return tok
    if tok.unk_token is not None:
        tok.pad_token = tok.unk_token
    else:
        tok.pad_token = tok.eos_token
        log.info(
            "tokenizer has no pad token; using EOS as pad (padding is masked by position, EOS "
            "still trains)"
        )
    return tok


def save_tokenizer(tokenizer, folder) -> None:
    """``save_pretrained``, and the SentencePiece model the tokenizer was built from beside it.
    transformers 5 saves a SentencePiece tokenizer (Gemma's, Llama 2's, Mistral's, Phi-3's) as
    ``tokenizer.json`` alone, and llama.cpp's converter reads those families' vocabulary only from
    ``tokenizer.model``: without the copy, a run of such a model could not be exported to GGUF."""
    import shutil

    tokenizer.save_pretrained(str(folder))
    source = tokenizer.init_kwargs.get("vocab_file")  # set by tokenizers built from a .model
    target = Path(folder) / "tokenizer.model"
    if source and Path(source).is_file() and Path(source).suffix == ".model":
        if not target.exists() or not target.samefile(source):
            shutil.copyfile(source, target)


def load_model(
    name: str,
    cfg: ModelConfig,
    tokenizer,
    dtype=None,
    attn_implementation: str = "sdpa",
    extra: dict | None = None,
    score_head: bool = False,
):
    """Build a preset from scratch, or load a Hub/local model through from_pretrained.
    ``score_head``: the model with a one-output sequence-classification head instead of its
    language-model head (a reward model: AutoModelForSequenceClassification, num_labels 1, the
    head initialised at random as transformers does, which is what TRL's RewardTrainer loads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if score_head else AutoModelForCausalLM
    head = {"num_labels": 1} if score_head else {}
    extra = dict(extra or {})
    dtype = dtype or torch.float32
    if is_preset(name):
        config = preset_config(name, tokenizer)
        config._attn_implementation = attn_implementation
        config.num_labels = 1 if score_head else config.num_labels
        return auto.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    _check_local(name)
    auto = _vision_class(name, cfg, score_head) or auto
    try:
        if cfg.from_scratch:
            config = AutoConfig.from_pretrained(
                name, trust_remote_code=cfg.trust_remote_code, **head
            )
            return auto.from_config(
                config,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
            )
        return auto.from_pretrained(
            name,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            **head,
            **extra,
        )
    except (OSError, ValueError) as exc:
        raise _load_error(name, exc) from None


def _vision_class(name: str, cfg: ModelConfig, score_head: bool):
    """transformers' image-text-to-text class for a vision-language model's folder, else None."""
    from onegpu import vlm

    try:
        config = model_config(name, cfg.trust_remote_code)
    except ModelError:
        return None  # the load itself reports why
    if not vlm.is_vision_config(config):
        return None
    vlm.check_family(config)
    if score_head:
        raise ModelError(
            f"'{name}' is a vision-language model; training.objective=reward builds a text "
            "model's score head.",
            hint="train a vision-language model with training.objective=sft",
        )
    return vlm.model_class()


def is_vision_model(name: str, trust_remote_code: bool = False) -> bool:
    """Whether ``name`` is a vision-language model (its config has a vision tower)."""
    from onegpu import vlm

    if is_preset(name):
        return False
    try:
        return vlm.is_vision_config(model_config(name, trust_remote_code))
    except ModelError:
        return False


def model_config(name: str, trust_remote_code: bool = False):
    """The config of the model ``load_model`` builds, read alone (config.json, no weights); presets
    are Llama."""
    from transformers import AutoConfig, LlamaConfig

    if is_preset(name):
        return LlamaConfig(**PRESETS[name])
    _check_local(name)
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error(name, exc) from None


def causal_lm_class(config, trust_remote_code: bool = False):
    """The class AutoModelForCausalLM builds for ``config``, found without building it; None when
    it cannot be told (remote code not trusted, or not fetchable)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if ref and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        repo, _, ref = ref.rpartition(
            "--"
        )  # "repo--module.Class" names code kept in another repository
        try:
            return get_class_from_dynamic_module(ref, repo or config.name_or_path)
        except (OSError, ValueError, ImportError):
            return None  # the load itself reports why
    mapping = (
        AutoModelForCausalLM._model_mapping
    )  # includes classes added with AutoModelForCausalLM.register
    return _get_model_class(config, mapping) if type(config) in mapping else None


def _load_error(name: str, exc: BaseException) -> ModelError:
    return ModelError(
        f"cannot load model '{name}': {_first_line(exc)}",
        hint=f"use a preset ({', '.join(PRESETS)}), a local directory, or a Hub id while online",
    )


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


def _check_local(name: str) -> None:
    p = Path(name)
    if _looks_local(name) and not (p.expanduser() / "config.json").is_file():
        raise ModelError(
            f"model directory '{name}' has no config.json.",
            hint="point --model.name at a folder written by save_pretrained (e.g. <run>/final)",
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _one_line(exc: BaseException) -> str:
    """The whole message on one line: a first line alone can stop mid-sentence ("... one of:")."""
    lines = (line.strip() for line in str(exc).splitlines())
    return " ".join(line for line in lines if line) or type(exc).__name__


def count_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
