"""The image tokens a vision-language model's training rows hold, by the processor's own rules
(patch size, merge size, max_pixels, a fixed count per image): what ``onegpu plan`` prints next to
the text tokens, from the run's data (--data.path) or for one image side (--image_size).

The planner plans rows of data.seq_len tokens, image tokens included; this says how many of them
the images take, and whether an example still fits.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from onegpu.config import Config
from onegpu.plan.vision import ImageLoad, load_for


@dataclass(frozen=True)
class ImageTokens:
    """Per example: the image tokens and the text tokens, as min / median / max."""

    examples: int
    image: tuple[int, int, int]
    text: tuple[int, int, int]
    source: str  # "the data" or "one 448x448 image"
    # the images of the example with the most image tokens, as the tower receives them: what the
    # planner counts the tower's and projector's activations for (plan/vision.py)
    load: ImageLoad | None = None

    def describe(self, seq_len: int) -> str:
        lo, mid, hi = self.image
        line = (
            f"image tokens per example ({self.source}, {self.examples} examples): {lo} / {mid} / "
            f"{hi} (min / median / max), text tokens {self.text[0]} / {self.text[1]} / "
            f"{self.text[2]}"
        )
        longest = max(a + b for a, b in zip(self.image, self.text, strict=True))
        if longest > seq_len:
            line += f"; the longest needs {longest} tokens, over data.seq_len={seq_len}"
        return line


def _spread(values: list[int]) -> tuple[int, int, int]:
    return min(values), int(statistics.median(values)), max(values)


def for_image_size(processor, side: int) -> ImageTokens:
    """The tokens one side x side image becomes, by the processor's own count (the method vLLM
    reads too: ``_get_num_multimodal_tokens``)."""
    from PIL import Image

    n = processor._get_num_multimodal_tokens(image_sizes=[(side, side)])["num_image_tokens"][0]
    load = load_for(processor, [Image.new("RGB", (side, side))])
    return ImageTokens(1, (n, n, n), (0, 0, 0), f"one {side}x{side} image", load)


def for_data(cfg: Config, processor) -> ImageTokens:
    """The run's own examples, tokenized as training tokenizes them (data/vision.py)."""
    from onegpu.data import records as records_io
    from onegpu.data.images import open_image
    from onegpu.data.vision import IMAGES, image_token_ids, tokenize_counted

    train, _, _ = records_io.load_records(cfg.data, cfg.training.seed)
    examples, _ = tokenize_counted(train, processor, cfg.data, "train")
    masked = image_token_ids(processor)
    image, text = [], []
    for ids in examples["input_ids"]:
        n = sum(1 for t in ids if t in masked)
        image.append(n)
        text.append(len(ids) - n)
    if not image:
        image, text = [0], [0]
    load = None
    if max(image):  # the heaviest example's images, opened as its batch opens them
        k = image.index(max(image))
        opened = [open_image(s, f"example {k}", cfg.data.image_size) for s in examples[k][IMAGES]]
        load = load_for(processor, opened, cfg.data)
    return ImageTokens(len(examples), _spread(image), _spread(text), "the data", load)


def image_tokens(cfg: Config, model_name: str, image_size: int | None) -> ImageTokens | None:
    """What the images of this run become, or None for a text model."""
    from onegpu import models, vlm

    if not models.is_vision_model(model_name, cfg.model.trust_remote_code):
        return None
    processor = vlm.load_processor(model_name, cfg.model.trust_remote_code)
    if image_size:
        return for_image_size(processor, image_size)
    if cfg.data.path:
        return for_data(cfg, processor)
    return None
