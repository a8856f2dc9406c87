"""transformers' own ``generate`` on batches of left-padded prompts: the reference the engine is
tested against, the bench's baseline, and the path for models the engine cannot serve."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from onegpu.infer.sampling_config import SamplingConfig

log = logging.getLogger(__name__)


def generate_batch(
    model, tokenizer, ids: list[list[int]], scfg: SamplingConfig, streamer
) -> list[tuple[list[int], str, str]]:
    """(new token ids, text, finish reason) per prompt of one left-padded batch."""
    import torch

    context = context_length(model)
    lengths = [len(row) for row in ids]
    multiple = _pad_multiple(scfg, max(lengths), context)
    # left: new tokens must follow each prompt directly (for this call: the caller's tokenizer
    # keeps its own side)
    enc = tokenizer.pad(
        {"input_ids": ids},
        padding=True,
        pad_to_multiple_of=multiple,
        padding_side="left",
        return_tensors="pt",
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
    return [_completion(row[width:], tokenizer, scfg.stop) for row in out.tolist()]


def _pad_multiple(scfg: SamplingConfig, longest: int, context: Optional[int]) -> Optional[int]:
    """With a static cache + compile, pad prompts to a multiple of 64 tokens so that prompts of
    similar length share one compiled graph instead of recompiling for every length."""
    if not (scfg.static_cache or scfg.compile not in ("off", "auto")):
        return None
    padded = -(-longest // 64) * 64
    return 64 if context is None or padded + 1 < context else None


def context_length(model) -> Optional[int]:
    # a vision-language model's: its language model's
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


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
    compiled = scfg.compile not in ("off", "auto")  # auto: transformers' generate runs eager
    if scfg.static_cache or compiled:
        kw["cache_implementation"] = "static"
    if compiled:
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


def _completion(new_ids: list[int], tokenizer, stops: list[str]) -> tuple[list[int], str, str]:
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
    return new_ids, text, finish


def TextCallback(tokenizer, on_text):  # noqa: N802 - builds a streamer object, as a class would
    """A transformers streamer that hands finished text to ``on_text`` (the prompt skipped)."""
    from transformers import TextStreamer

    class _Callback(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            on_text(text)

    return _Callback(tokenizer, skip_prompt=True, skip_special_tokens=True)
