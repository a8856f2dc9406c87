"""``onegpu generate``'s batch API: prompts in, completions out, through the decode engine
(``decoder="engine"``, the default) or transformers' own ``generate`` (``decoder="hf"``: the
reference, and what the old flags static_cache/compile drive)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

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
    decoder: Literal["engine", "hf"] = "engine"
    """engine: onegpu's decode engine (a KV cache sized to the request, all prompts decoded
    together as slots free up, sampling on the device). hf: transformers' generate (left-padded
    batches; static_cache applies)."""
    compile: Literal["auto", "off", "default", "reduce-overhead", "max-autotune"] = "auto"
    """torch.compile the one-token decode step. auto: on a GPU (captured as a CUDA graph), not on
    a CPU (compiling takes about a minute there). The first call pays for compilation."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    static_cache: bool = False
    """decoder hf: preallocate transformers' KV cache to its final size (the engine always does,
    sized to the request)."""


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
    on_text: Optional[Callable[[str], None]] = None,
    data_format: Optional[str] = None,
) -> list[Completion]:
    """A completion per prompt. ``on_text`` receives the text of a single prompt as it is made.

    ``data_format``: what the model was trained on, when known (``Loaded.data_format``); with
    ``scfg.chat="auto"``, "messages" feeds the prompts as chat turns."""
    _check_sampling(scfg)
    chat = use_chat(scfg.chat, tokenizer, data_format)
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"prompt {i + 1} is empty.",
                hint="remove empty prompts (or blank lines in the prompt file)",
            )
    ids = prompt_ids(tokenizer, prompts, chat)
    context = _check_lengths(model, ids)
    if scfg.decoder == "hf":
        return _hf(model, tokenizer, prompts, ids, scfg, on_text)
    from onegpu.infer.engine_generate import engine_generate

    max_new = _fit(scfg.max_new_tokens, max(map(len, ids)), context)
    return [
        Completion(p, r.text, len(r.token_ids), r.finish_reason)
        for p, r in zip(
            prompts, engine_generate(model, tokenizer, ids, scfg, max_new, on_text), strict=True
        )
    ]


def _check_lengths(model, ids: list[list[int]]) -> Optional[int]:
    from onegpu.infer.hf_generate import context_length

    context = context_length(model)
    for i, row in enumerate(ids):
        if context and len(row) >= context:
            raise DataError(
                f"prompt {i + 1} is {len(row)} tokens; the model's context is {context} tokens.",
                hint=f"shorten the prompt to under {context} tokens",
            )
    return context


def _fit(max_new: int, longest: int, context: Optional[int]) -> int:
    if context and longest + max_new > context:
        log.warning(
            "max_new_tokens lowered from %d to %d to stay within the %d-token context",
            max_new,
            context - longest,
            context,
        )
        return context - longest
    return max_new


def _hf(model, tokenizer, prompts, ids, scfg: SamplingConfig, on_text) -> list[Completion]:
    from transformers import set_seed

    from onegpu.infer.hf_generate import TextCallback, generate_batch

    set_seed(scfg.seed)
    streamer = TextCallback(tokenizer, on_text) if on_text else None
    done: list[Completion] = []
    for start in range(0, len(prompts), scfg.batch_size):
        rows = generate_batch(
            model, tokenizer, ids[start : start + scfg.batch_size], scfg, streamer
        )
        done += [
            Completion(p, text, len(new), finish)
            for p, (new, text, finish) in zip(prompts[start:], rows, strict=False)
        ]
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
