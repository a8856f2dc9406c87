"""Generation from batches of prompts (left padded), with stop strings, sampling settings and an
optional static cache + compiled decode step."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from onegpu.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass
class SamplingConfig:
    """How prompts are fed to the model and completions sampled."""

    chat: Union[bool, Literal["auto"]] = "auto"
    """Prompts are user turns: each is put through the tokenizer's chat template, ending where the
    assistant's answer begins. auto: on for a model onegpu trained on chat (messages) data, off for
    anything else (a template alone decides nothing: base models ship one, and so does every
    tokenizer onegpu trains). true needs a tokenizer with a chat template."""
    max_new_tokens: int = 128
    """Tokens to generate per prompt at most."""
    greedy: bool = False
    """Always pick the most likely token (deterministic). Same as temperature 0."""
    temperature: float = 0.8
    """Sampling temperature (0 = greedy)."""
    top_p: float = 0.95
    """Nucleus sampling: sample from the smallest token set with this total probability (1 = off).
    """
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
class Completion:
    prompt: str
    text: str
    new_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)


def generate(
    model,
    tokenizer,
    prompts: list[str],
    scfg: SamplingConfig,
    streamer=None,
    data_format: Optional[str] = None,
) -> list[Completion]:
    """Generate a completion per prompt, ``scfg.batch_size`` prompts at a time (left padded).

    ``data_format``: what the model was trained on, when known (``Loaded.data_format``); with
    ``scfg.chat="auto"``, "messages" feeds the prompts as chat turns."""
    from transformers import set_seed

    _check_sampling(scfg)
    chat = use_chat(scfg.chat, tokenizer, data_format)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"prompt {i + 1} is empty.",
                hint="remove empty prompts (or blank lines in the prompt file)",
            )
    set_seed(scfg.seed)
    done: list[Completion] = []
    for start in range(0, len(prompts), scfg.batch_size):
        done += _generate_batch(
            model, tokenizer, prompts[start : start + scfg.batch_size], scfg, streamer, start, chat
        )
    return done


def use_chat(chat: Union[bool, str], tokenizer, data_format: Optional[str] = None) -> bool:
    """Whether the prompts go through the chat template (SamplingConfig.chat)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is True and not has_template:
        raise ConfigError(
            "--chat true needs a tokenizer with a chat template; this one has none.",
            hint="drop --chat (prompts are then plain text), or pass --tokenizer with a chat "
            "template",
        )
    if chat != "auto":
        return bool(chat)
    if has_template and data_format is None:  # a Hub model: an instruct model wants its template
        log.info(
            "the tokenizer has a chat template; prompts are fed as plain text (--chat true for "
            "chat turns)"
        )
    return has_template and data_format == "messages"


def prompt_ids(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: as text, or as one user turn followed by the assistant's turn
    opening (the template decides the special tokens, so none are added on top)."""
    if not chat:
        return tokenizer(prompts)["input_ids"]
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        out.append(
            list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        )  # a BatchEncoding in transformers 5
    return out


def _check_sampling(scfg: SamplingConfig) -> None:
    checks = {
        "max_new_tokens": scfg.max_new_tokens >= 1,
        "batch_size": scfg.batch_size >= 1,
        "temperature": scfg.temperature >= 0,
        "top_p": 0 < scfg.top_p <= 1,
        "top_k": scfg.top_k >= 0,
        "repetition_penalty": scfg.repetition_penalty > 0,
    }
    for name, ok in checks.items():
        if not ok:
            raise ConfigError(
                f"--{name} has an invalid value: {getattr(scfg, name)}.",
                hint="max_new_tokens, batch_size >= 1; temperature, top_k >= 0; 0 < top_p <= 1",
            )
    if any(not s for s in scfg.stop):
        raise ConfigError(
            "--stop contains an empty string.",
            hint="remove it; an empty stop string would stop at once",
        )


def _generate_batch(
    model, tokenizer, prompts: list[str], scfg: SamplingConfig, streamer, offset: int, chat: bool
):
    import torch

    context = _context_length(model)
    ids = prompt_ids(tokenizer, prompts, chat)
    lengths = [len(row) for row in ids]
    for i, n in enumerate(lengths):
        if context and n >= context:
            raise DataError(
                f"prompt {offset + i + 1} is {n} tokens; the model's context is {context} tokens.",
                hint=f"shorten the prompt to under {context} tokens",
            )
    tokenizer.padding_side = "left"  # new tokens must follow each prompt directly
    multiple = _pad_multiple(scfg, max(lengths), context)
    enc = tokenizer.pad(
        {"input_ids": ids}, padding=True, pad_to_multiple_of=multiple, return_tensors="pt"
    ).to(_input_device(model))
    width = enc["input_ids"].shape[1]
    max_new = scfg.max_new_tokens
    if context and width + max_new > context:
        max_new = context - width
        log.warning(
            "max_new_tokens lowered from %d to %d to stay within the %d-token context",
            scfg.max_new_tokens,
            max_new,
            context,
        )
    with torch.inference_mode():
        out = model.generate(
            **enc, **generation_kwargs(model, tokenizer, scfg, max_new), streamer=streamer
        )
    return [
        _completion(p, row[width:], tokenizer, scfg.stop)
        for p, row in zip(prompts, out.tolist(), strict=True)
    ]


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
        kw["disable_compile"] = (
            True  # transformers would otherwise auto-compile static-cache decoding on GPUs
        )
    return kw


def _compile_config(model, scfg: SamplingConfig):
    from transformers import CompileConfig

    mode = scfg.compile
    if model.device.type != "cuda" and mode == "reduce-overhead":
        mode = "default"  # reduce-overhead means CUDA graphs; there is nothing to capture elsewhere
    # dynamic=False: the static cache keeps decode shapes fixed, so one specialised graph serves all
    # steps.
    cc = CompileConfig(backend=scfg.compile_backend, mode=mode, fullgraph=False, dynamic=False)
    # transformers compiles only on accelerators unless told; we compile where the user asked.
    cc._compile_all_devices = True
    return cc


def _completion(prompt: str, new_ids: list[int], tokenizer, stops: list[str]) -> Completion:
    eos = tokenizer.eos_token_id
    finish = "length"
    if eos is not None and eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos) + 1]
        finish = "stop"
    elif tokenizer.pad_token_id is not None and tokenizer.pad_token_id in new_ids:
        # a sequence that hit a stop string is padded while the rest of its batch finishes
        new_ids = new_ids[: new_ids.index(tokenizer.pad_token_id)]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
    return Completion(prompt, text, len(new_ids), finish)
