"""``onegpu generate``'s batch API: prompts in, completions out, through the decode engine
(``decoder="engine"``, the default) or transformers' own ``generate`` (``decoder="hf"``: the
reference, and what the old flags static_cache/compile drive)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Optional, Union

from onegpu.errors import ConfigError, DataError
from onegpu.infer.sampling_config import Completion, SamplingConfig

__all__ = ["Completion", "SamplingConfig", "generate", "generate_chats", "prompt_ids", "use_chat"]

log = logging.getLogger(__name__)


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


def generate_chats(
    model,
    processor,
    chats: list[list[dict]],
    scfg: SamplingConfig,
    on_text: Optional[Callable[[str], None]] = None,
) -> list[Completion]:
    """A completion per chat of a vision-language model (messages whose content may hold image
    parts; image paths absolute), on the engine: each rendered with its processor's chat template
    and the assistant's turn opened, its images fed with its prompt (infer/images.py). A
    completion's prompt is the chat's last text part."""
    from onegpu.infer.engine_generate import engine_generate
    from onegpu.infer.images import chat_prompt

    _check_sampling(scfg)
    if scfg.decoder != "engine":
        raise ConfigError(
            f"--decoder {scfg.decoder}: prompts with images run on the engine.",
            hint="drop --decoder (the engine is the default)",
        )
    encoded = [chat_prompt(processor, c, f"prompt {i + 1}") for i, c in enumerate(chats)]
    ids = [e[0] for e in encoded]
    max_new = _fit(scfg.max_new_tokens, max(map(len, ids)), _check_lengths(model, ids))
    got = engine_generate(
        model, processor.tokenizer, ids, scfg, max_new, on_text, [e[1] for e in encoded]
    )
    return [
        Completion(_last_text(c), r.text, len(r.token_ids), r.finish_reason)
        for c, r in zip(chats, got, strict=True)
    ]


def _last_text(chat: list[dict]) -> str:
    content = chat[-1].get("content") if chat else ""
    if isinstance(content, str):
        return content
    texts = [p.get("text", "") for p in content or [] if isinstance(p, dict)]
    return next((t for t in reversed(texts) if t), "")


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
    if scfg.speculative is not None and scfg.decoder == "hf":
        raise ConfigError(
            "--speculative is the decode engine's; --decoder hf does not speculate.",
            hint="use --decoder engine (the default), or leave --speculative out",
        )
    if any(not s for s in scfg.stop):
        raise ConfigError(
            "--stop contains an empty string.",
            hint="remove it; an empty stop string would stop at once",
        )
