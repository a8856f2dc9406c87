"""Chat records with images -> training examples -> batches, through the model's own processor.

Tokenizing: the processor renders the conversation with its chat template and expands each image
placeholder into the tokens that image becomes (its rules: patch and merge sizes, max_pixels,
tiles). Labels are the assistant turns' tokens only, found by processing the conversation up to
each turn (with that prefix's images) and taking where the prefix's tokens end: the system and user
turns, the image tokens and padding never count. Image tokens are masked by id as well, wherever
they sit.

An example keeps its rendered text and its image sources; the collator runs the processor again on
the batch's texts and images (the one place that knows how this family lays out pixel values:
concatenated patches, per-example tiles, masks), checks its token ids against the example's, and
pads the labels to the same width. So a batch's image features are exactly its own examples', in
order. A record over data.seq_len is dropped whatever data.overlong says: a cut would leave image
tokens without their features or features without their tokens.
"""

from __future__ import annotations

import logging

from onegpu.config import DataConfig
from onegpu.data import overlong, records, validate
from onegpu.data.images import BadImage, open_image, origin_folder, split_images
from onegpu.errors import DataError

log = logging.getLogger(__name__)
IGNORE = overlong.IGNORE
TEXT, IMAGES = "text", "images"  # the columns an example keeps for its batch


def image_kwargs(processor, cfg: DataConfig) -> dict:
    """data.max_pixels / min_pixels as the processor's own arguments; an error where its image
    processor has no such setting (data.image_size resizes before any processor)."""
    out = {}
    accepted = _image_settings(processor)
    for key in ("max_pixels", "min_pixels"):
        value = getattr(cfg, key)
        if not value:
            continue
        if key not in accepted:
            raise DataError(
                f"data.{key}={value}: {type(processor.image_processor).__name__} has no {key} "
                "setting (its images become a fixed number of tokens, or tiles).",
                hint="set data.image_size to bound the longest side instead, or leave "
                f"data.{key} at 0",
            )
        out[key] = value
    return out


def _image_settings(processor) -> set[str]:
    kinds = getattr(type(processor.image_processor), "valid_kwargs", None)
    return set(getattr(kinds, "__annotations__", {}))


def image_token_ids(processor) -> set[int]:
    """The placeholder ids the processor writes for images (never a target)."""
    ids = {i for i in processor.image_token_ids if i is not None}
    tok = processor.tokenizer
    for attr in ("boi_token", "eoi_token", "image_token"):
        token = getattr(tok, attr, None)  # Gemma 3's tokenizer names its image markers
        if token:
            ids.add(tok.convert_tokens_to_ids(token))
    return ids


class Encoder:
    """encode(conversation, image sources) -> (input_ids, assistant turn per token): the
    processor's tokens of the rendered chat, as data/batches._encode_chat gives for text."""

    def __init__(self, processor, cfg: DataConfig):
        self.processor, self.cfg = processor, cfg
        self.kwargs = image_kwargs(processor, cfg)
        self.masked = image_token_ids(processor)

    def render(self, conv: list, generation_prompt: bool = False) -> str:
        return self.render_with(self.processor, conv, generation_prompt)

    @staticmethod
    def render_with(processor, conv: list, generation_prompt: bool = False) -> str:
        """The conversation as the processor's chat template writes it (the engine's prompts are
        rendered so too: infer/images.py)."""
        return processor.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=generation_prompt
        )

    def ids(self, text: str, images: list) -> list[int]:
        out = self.processor(
            text=[text],
            images=[images] if images else None,
            add_special_tokens=False,
            **self.kwargs,
        )
        return list(out["input_ids"][0])

    def encode(self, conv: list, images: list) -> tuple[list[int], list[int], str]:
        text = self.render(conv)
        ids = self.ids(text, images)
        turn = [-1] * len(ids)
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            before = _count_images(conv[:i])
            start = _common(ids, self.ids(self.render(conv[:i], True), images[:before])) if i else 0
            # What a template writes after the turn's end is layout, not the reply (as for text).
            upto = self.ids(
                self.render(conv[: i + 1]).rstrip(), images[: _count_images(conv[: i + 1])]
            )
            for t in range(start, _common(ids, upto)):
                turn[t] = -1 if ids[t] in self.masked else i
        return ids, turn, text


def _count_images(conv: list) -> int:
    return sum(
        1
        for m in conv
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    )


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix: where a prefix's tokens end inside the whole (a token merged
    across the boundary stays with the prompt, never trained on)."""
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def tokenize_batch(batch, indices, encoder: Encoder, cfg: DataConfig, split: str):
    """datasets.map function: rows of input_ids, labels, text, images and the record's fate."""
    out = {
        "input_ids": [],
        "labels": [],
        TEXT: [],
        IMAGES: [],
        overlong.FATE: [],
        overlong.TURNS: [],
    }
    column = batch.get(cfg.images_field)
    for i, (idx, conv) in enumerate(zip(indices, batch[cfg.messages_field], strict=True)):
        where = records.where(batch, i, idx, split)
        problem = validate.chat_problem(conv)
        if problem:
            raise DataError(f"{where}: {problem[0]}", hint=problem[1])
        origin = (batch.get(records.ORIGIN) or [None] * len(indices))[i]
        conv, sources = split_images(
            conv, column[i] if column else None, where, origin_folder(origin)
        )
        try:
            images = [open_image(s, where, cfg.image_size) for s in sources]
        except BadImage:
            if cfg.on_bad_record == "error":
                raise
            _row(out, [], [], "", [], overlong.BAD)
            continue
        ids, turn, text = encoder.encode(conv, images)
        _check_image_tokens(ids, encoder.masked, cfg, where, len(images))
        labels = overlong.labelled(ids, turn)
        if len(ids) > cfg.seq_len:
            _row(out, [], [], "", [], overlong.DROPPED)
        elif not overlong.trainable(labels):
            _row(out, [], [], "", [], overlong.EMPTY)
        else:
            _row(out, ids, labels, text, sources, overlong.FIT)
    return out


def _row(out: dict, ids, labels, text: str, sources: list, fate: int) -> None:
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out[TEXT].append(text)
    out[IMAGES].append(sources)
    out[overlong.FATE].append(fate)
    out[overlong.TURNS].append(0)


def _check_image_tokens(ids, masked: set, cfg: DataConfig, where: str, n_images: int) -> None:
    """Images that alone fill data.seq_len: no setting of data.overlong can keep such a record, so
    say what the images became and how to make them smaller."""
    n = sum(1 for t in ids if t in masked)
    if n_images and n >= cfg.seq_len:
        raise DataError(
            f"{where}: its {n_images} image(s) become {n} tokens, at least data.seq_len="
            f"{cfg.seq_len}: the resolution is over what a training sequence holds.",
            hint="lower data.max_pixels (or data.image_size), or raise data.seq_len",
        )


def tokenize_counted(ds, processor, cfg: DataConfig, split: str):
    """(the examples, what became of the records), as batches.tokenize_counted for text. One
    process: the processor is not sent to datasets' workers."""
    out = ds.map(
        tokenize_batch,
        batched=True,
        with_indices=True,
        remove_columns=ds.column_names,
        desc="tokenizing (messages with images)",
        fn_kwargs={"encoder": Encoder(processor, cfg), "cfg": cfg, "split": split},
    )
    stats = overlong.count(out, split, "messages", "drop", cfg.seq_len)
    out = out.filter(
        lambda fates: [f in overlong.KEPT for f in fates],
        batched=True,
        input_columns=overlong.FATE,
        desc="dropping over-long, empty and unreadable",
    )
    return out.remove_columns([overlong.FATE, overlong.TURNS]), stats


def announce(cfg: DataConfig) -> None:
    if cfg.overlong != "drop":
        log.info(
            "data.overlong=%s: vision-language records over data.seq_len are dropped instead "
            "(a cut would separate image tokens from their features); packing is off for them",
            cfg.overlong,
        )


class VisionCollator:
    """A batch of examples with images: the processor's pixel values (and whatever else its family
    feeds the model: image_grid_thw, pixel_attention_mask, token_type_ids) for these examples, and
    our labels, padded right to a multiple of ``multiple``."""

    def __init__(self, processor, cfg: DataConfig):
        self.processor, self.cfg = processor, cfg
        self.kwargs = image_kwargs(processor, cfg)

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        images = [
            [open_image(s, f"example {k}", self.cfg.image_size) for s in ex[IMAGES]]
            for k, ex in enumerate(examples)
        ]
        enc = self.processor(
            text=[ex[TEXT] for ex in examples],
            images=images if any(images) else None,
            add_special_tokens=False,
            padding="longest",
            padding_side="right",
            pad_to_multiple_of=self.cfg.pad_to_multiple,
            return_tensors="pt",
            **self.kwargs,
        )
        batch = dict(enc)
        labels = torch.full_like(batch["input_ids"], IGNORE)
        for i, ex in enumerate(examples):
            k = len(ex["input_ids"])
            got = batch["input_ids"][i, :k].tolist()
            if got != list(ex["input_ids"]) or int(batch["attention_mask"][i].sum()) != k:
                raise DataError(
                    "the processor tokenized an example differently in its batch than when the "
                    "data was tokenized (its image settings changed?).",
                    hint="clear the tokenized cache (ONEGPU_CACHE) and start again",
                )
            labels[i, :k] = torch.as_tensor(ex["labels"])
        batch["labels"] = labels
        return batch
