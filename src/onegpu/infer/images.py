"""A prompt's images in the decode engine: what the model's processor made of them, the prompt
piece that feeds them to the model, and how they key the prefix cache.

A request with images carries the processor's tensors for them (``pixel_values`` and whatever
else its family's forward reads: ``image_sizes``, ``pixel_attention_mask``, ...) beside its
token ids, where the processor has already expanded each image into its placeholder tokens. The
piece of the prompt that holds the placeholders runs the model's own forward with those tensors
(its vision tower, its projector, its placement of the features into the embeddings), over the
paged KV as any piece; decode steps then run the language model on tokens alone, as for text.

- The placeholders are computed in one piece: a family's forward takes an image's features whole
  (its count of placeholder tokens is checked against them), so a prompt is not cut inside them.
  The piece that holds them runs alone (pixel tensors are laid out per family: patches
  concatenated, tiles per image; one request's at a time keeps each its own).
- The prefix cache: a block is keyed by its tokens, the adapter and the content hash of each
  image whose placeholders fall in it (``cache_key``: kv_blocks.SpanKeys), and a block after an
  image carries it through its parent's hash, as vLLM keys them. A system prompt before the
  first image is so shared across requests with other images; two prompts of equal tokens and
  different images share no block at or after the first difference; a repeated image with its
  prompt is found again. A cached prefix is used up to the first placeholder, or past the last
  one (then no image is computed again), never into them.
- Gemma 3 lets an image's tokens attend to each other both ways (its ``token_type_ids``): the
  piece's causal mask gets that overlay (``bidirectional``), as transformers' own prefill does.
- Families whose rotary positions are multimodal (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: mrope) take
  their positions apart from the KV slots: infer/mrope.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

from onegpu.errors import ConfigError
from onegpu.infer.kv_blocks import SpanKeys

# what a processor returns that is the prompt's, not its images'
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images as its model's processor made them."""

    features: dict
    """The processor's image tensors for this one prompt, by the model's forward argument name
    (pixel_values, image_sizes, pixel_attention_mask, ...)."""
    digest: str
    """A hash of those tensors' contents: the prefix cache's key for the image."""
    start: int
    """The prompt position of the first image placeholder token."""
    end: int
    """One past the last placeholder token."""
    blocks: Optional[tuple[int, ...]] = None
    """Per prompt token, the image it belongs to where that image's tokens attend to each other
    both ways (Gemma 3), -1 elsewhere; None for a family with causal attention throughout."""
    spans: tuple[tuple[int, int, str], ...] = ()
    """Each image's ``(first placeholder, one past its last, content hash)``: what keys the
    prefix cache's blocks that hold it (``cache_key``); one span over all of them where the
    placeholders do not tell the images apart (more runs of them than images: Idefics3's tiles)."""
    types: Optional[tuple[int, ...]] = None
    """Per prompt token, its modality as the processor marks it (``mm_token_type_ids``: 0 text,
    1 image), where it does: what an mrope family's positions are computed from."""
    rope_positions: Optional[Any] = None
    """An mrope family's rotary positions of the prompt ``[3, len]`` (infer/mrope.py)."""
    rope_delta: int = 0
    """How far its text after the images sits past its KV slots (mrope; 0 for the others)."""


def prompt_images(processor, text: str, images: list, **kwargs) -> tuple[list[int], PromptImages]:
    """(the token ids, their images) of a rendered prompt ``text`` with ``images`` (PIL), as the
    processor makes them; ``kwargs``: its image settings (max_pixels, ...)."""
    out = processor(
        text=[text], images=[images], add_special_tokens=False, return_tensors="pt", **kwargs
    )
    ids = out["input_ids"][0].tolist()
    features = {k: v for k, v in out.items() if k not in TEXT_KEYS}
    placeholders = _placeholder_ids(processor)
    at = [i for i, t in enumerate(ids) if t in placeholders]
    if not at:
        raise ConfigError(
            "the prompt has images but no image placeholder: its chat template wrote none.",
            hint='give each image an {"type": "image"} part in a message',
        )
    types = out.get("token_type_ids")
    blocks = _blocks(types[0].tolist()) if types is not None and _bidirectional(processor) else None
    whole = digest(features)
    spans = _spans(at, images, whole, _settings(processor, kwargs))
    modality = out.get("mm_token_type_ids")
    modality = None if modality is None else tuple(modality[0].tolist())
    return ids, PromptImages(features, whole, at[0], at[-1] + 1, blocks, spans, modality)


def _settings(processor, kwargs: dict) -> str:
    """What turns an image into its features besides its pixels: the image processor's settings
    and the call's."""
    return f"{processor.image_processor.to_json_string()}{sorted(kwargs.items())}"


def _spans(at: list[int], images: list, whole: str, settings: str) -> tuple:
    """Each image's span of placeholders and its hash (its pixels with ``settings``), where the
    placeholders come in one run per image; else one span over all of them, hashed by all the
    features (``whole``)."""
    runs = [[at[0], at[0] + 1]]
    for i in at[1:]:
        if i == runs[-1][1]:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    if len(runs) != len(images):
        return ((at[0], at[-1] + 1, whole),)
    return tuple(
        (s, e, _image_hash(img, settings)) for (s, e), img in zip(runs, images, strict=True)
    )


def _image_hash(image, settings: str) -> str:
    """sha256 of a PIL image's mode, size and pixels, and of the settings that process it."""
    h = hashlib.sha256(f"{image.mode}{image.size}{settings}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _placeholder_ids(processor) -> set[int]:
    from onegpu.data.vision import image_token_ids

    return image_token_ids(processor)


def _bidirectional(processor) -> bool:
    """Gemma 3's processor marks its image tokens with token_type_ids, which its model reads as
    "attend both ways within the image"."""
    return type(processor).__name__.startswith("Gemma3")


def _blocks(types: list[int]) -> tuple[int, ...]:
    """transformers' get_block_sequence_ids_for_mask for one row: each run of image tokens
    (type 1) numbered from 0, -1 elsewhere."""
    out, group, before = [], -1, False
    for t in types:
        image = t == 1
        group += image and not before
        out.append(group if image else -1)
        before = image
    return tuple(out)


def digest(features: dict) -> str:
    """sha256 of the tensors' names, shapes, dtypes and bytes."""
    import torch

    h = hashlib.sha256()
    for name in sorted(features):
        t = features[name].contiguous().cpu()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_key(adapter_key: Optional[str], images: Optional[PromptImages]):
    """What a sequence's blocks are hashed by beside their tokens: the adapter, and in each block
    that holds an image's placeholders that image's hash (kv_blocks.SpanKeys)."""
    if images is None:
        return adapter_key
    return SpanKeys(adapter_key, images.spans or ((images.start, images.end, images.digest),))


def usable_prefix(images: Optional[PromptImages], cached: int, block_size: int) -> int:
    """How many of ``cached`` whole cached blocks a sequence takes: all of them unless they end
    inside its placeholders (their features come whole), else those before the first one."""
    if images is None or not images.start < cached * block_size < images.end:
        return cached
    return images.start // block_size


def piece_end(images: Optional[PromptImages], computed: int, end: int, total: int) -> int:
    """A prompt piece from ``computed`` planned to end at ``end``: to the prompt's end where it
    would start before the placeholders' end and stop before it (the placeholders in one piece)."""
    if images is None or computed >= images.end or end >= images.end:
        return end
    return total


def check(model, images: Optional[PromptImages], prompt_ids: list[int]) -> None:
    """A request with images: a vision-language model, and placeholders inside the prompt."""
    if images is None:
        return
    if getattr(model.config, "vision_config", None) is None:
        raise ConfigError(
            f"the request has images, but {type(model).__name__} is a text-only model.",
            hint="send text only, or serve a vision-language model",
        )
    if not 0 <= images.start < images.end <= len(prompt_ids):
        raise ConfigError(
            f"the request's image placeholders [{images.start}, {images.end}) are not inside "
            f"its prompt of {len(prompt_ids)} tokens.",
            hint="make the ids and the images with the model's processor (infer.images)",
        )


def feeds(images: Optional[PromptImages], start: int) -> bool:
    """Whether a piece of the prompt starting at ``start`` computes its images (the piece then
    holds every placeholder: ``piece_end``, ``usable_prefix``)."""
    return images is not None and start < images.end


def model_inputs(images, start: int, device=None, dtype=None) -> dict[str, Any]:
    """The image tensors a piece starting at ``start`` feeds the forward (on ``device``, floats in
    ``dtype``): all of them where it holds the placeholders, none where they were computed before
    (a cached prefix)."""
    if not feeds(images, start):
        return {}
    return {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
        for k, v in images.features.items()
    }


def bidirectional(mask, images: Optional[PromptImages], start: int, length: int):
    """``mask`` (the piece's causal mask ``[1, 1, length, kv_len]``, bool or additive; or a dict
    of them by layer type) with each image's tokens attending to all of that image's tokens."""
    if images is None or images.blocks is None or start >= images.end:
        return mask
    if isinstance(mask, dict):
        return {k: bidirectional(m, images, start, length) for k, m in mask.items()}
    import torch

    kv_len = mask.shape[-1]
    ids = torch.full((kv_len,), -1, dtype=torch.long)
    known = torch.tensor(images.blocks[:kv_len])
    ids[: len(known)] = known
    ids = ids.to(mask.device)
    q = ids[start : start + length]
    both = (q[:, None] == ids[None, :]) & (q[:, None] >= 0)
    if mask.dtype == torch.bool:
        return mask | both
    return mask.masked_fill(both, 0.0)


def chat_prompt(processor, conv: list, where: str, longest_side: int = 0):
    """(token ids, PromptImages or None) of a chat ``conv`` whose messages may hold image parts
    (``{"type": "image", "image": PATH}``, OpenAI's ``image_url``), rendered with the assistant's
    turn opened: data/images.py reads the images (paths must be absolute by now, as
    ``data.images.resolve`` makes them), the processor's chat template renders the turns as in
    training (data/vision.py) and its rules expand each image into its placeholders."""
    from pathlib import Path

    from onegpu.data.images import open_image, split_images
    from onegpu.data.vision import Encoder

    conv, sources = split_images(conv, None, where, Path.cwd())
    text = Encoder.render_with(processor, conv, generation_prompt=True)
    if not sources:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
    return prompt_images(processor, text, [open_image(s, where, longest_side) for s in sources])
