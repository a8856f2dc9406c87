"""Multimodal rotary positions (mrope: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) in the decode engine.

These families give each token three rotary positions (time, height, width). A text token's three
are equal; an image's placeholders take the grid of its patches, so the text after an image sits
at ``KV slot + rope_delta`` (the prompt's offset, which the model's own ``get_rope_index``
computes with its positions). The engine keeps the KV slot as it is (where a token's KV goes and
what its mask reads) and gives the forward the rotary positions apart, as ``position_ids``:

- at submit, a prompt with images gets the model's ``get_rope_index`` of the whole prompt: its
  positions (for the piece that computes the images) and its delta (``with_rope``);
- each decode row holds its delta (``Rows.rope_delta``: 0 for a text prompt), which decode steps,
  prompt pieces after the images (a cached prefix past them) and speculative verification add to
  the slot (``rotary``);
- a model without mrope has no deltas (None): its forwards and its compiled decode step are as
  they were.

transformers' ``generate`` does the same: the prompt's positions from ``get_rope_index``, then
``cache position + rope_deltas`` for every section of each later token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from onegpu.errors import ConfigError
from onegpu.infer.images import PromptImages, feeds
from onegpu.infer.paged_cache import base_model

# the model types whose get_rope_index the engine calls (each tested against generate)
FAMILIES = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}


def applies(model) -> bool:
    """``model`` is one of the mrope families the engine runs."""
    return base_model(model).config.model_type in FAMILIES


def check_model(model) -> None:
    """An mrope family the engine has not been checked on (GLM-4V, Qwen3-VL-MoE, the Omni models:
    transformers gives each a ``get_rope_index`` of its own) is refused by name."""
    base = base_model(model)
    kind = base.config.model_type
    # the families' positions come from that method of their model or its inner model: the one
    # mark they share (their configs' rope parameters name the sections only in checkpoints)
    own = any(hasattr(m, "get_rope_index") for m in (base, *base.children()))
    if own and kind not in FAMILIES:
        raise ConfigError(
            f"the decode engine does not run {kind} models: their rotary positions are "
            "multimodal (mrope), and the engine places them only for "
            f"{', '.join(FAMILIES.values())}.",
            hint="generate with transformers' generate on this family",
        )


def with_rope(model, images: Optional[PromptImages], prompt_ids: list[int]):
    """``images`` with their prompt's rotary positions and delta from the model's own
    ``get_rope_index`` (an mrope family's; others' and a text prompt's as they are)."""
    if images is None or not applies(model):
        return images
    if images.types is None:
        raise ConfigError(
            "the request's images carry no mm_token_type_ids, which this family's rotary "
            "positions are computed from.",
            hint="make the ids and the images with the model's processor (infer.images)",
        )
    grid = images.features.get("image_grid_thw")
    with torch.no_grad():
        positions, delta = base_model(model).model.get_rope_index(
            torch.tensor([prompt_ids]),
            mm_token_type_ids=torch.tensor([images.types]),
            image_grid_thw=None if grid is None else grid.cpu(),
        )
    return replace(images, rope_positions=positions[:, 0], rope_delta=int(delta.reshape(-1)[0]))


def delta_of(images: Optional[PromptImages]) -> int:
    """How far a prompt's text after its images sits past its KV slots (0 without images)."""
    return 0 if images is None else images.rope_delta


def rotary(images: Optional[PromptImages], start: int, positions: torch.Tensor, deltas):
    """The ``position_ids`` of a forward whose tokens sit at KV ``positions [rows, length]``:
    ``positions`` for a model without mrope (``deltas`` None); for an mrope one, where a piece
    from ``start`` computes its images, get_rope_index's positions ``[3, 1, length]`` (past the
    prompt, a recomputed answer's tokens at slot + delta); elsewhere each row's slots + its delta
    ``[1, rows, length]`` (the model broadcasts them to its three sections)."""
    if deltas is None:
        return positions
    if not feeds(images, start):
        return (positions + deltas[:, None])[None]
    known = images.rope_positions.to(positions.device)
    end = start + positions.shape[1]
    if end > known.shape[1]:  # an answer recomputed after preemption: text after the prompt
        after = torch.arange(known.shape[1], end, device=known.device) + images.rope_delta
        known = torch.cat([known, after[None].expand(3, -1)], dim=1)
    return known[:, None, start:end]
