"""Records -> training examples -> padded batches, and a resumable, seeded batch order."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

from onegpu.config import DataConfig
from onegpu.data import overlong, records, validate
from onegpu.errors import DataError

log = logging.getLogger(__name__)
IGNORE = overlong.IGNORE


# ------------------------------------------------------------------------------------ tokenizing
def tokenize_counted(
    ds, fmt: str, tok, cfg: DataConfig, split: str = "train", tools: list | None = None
) -> tuple[Any, overlong.DataStats]:
    """Tokenize, pack or mask, apply data.overlong; return the examples and what became of the
    records. Preference pairs become prompt_ids / chosen_ids / rejected_ids (data/pairs.py).
    ``tools``: GRPO's tool schemas, which the chat template renders into every chat prompt."""
    from onegpu.data import pairs, prompts, unpaired

    fn = {
        "text": _text,
        "prompt_completion": _prompt_completion,
        "messages": _messages,
        "preference": pairs.tokenize_batch,
        "prompt": prompts.tokenize_batch,
        "unpaired": unpaired.tokenize_batch,
    }[fmt]
    kw = dict(
        batched=True,
        with_indices=True,
        # prompts keep their columns: the reward functions read them
        remove_columns=[] if fmt == "prompt" else ds.column_names,
        desc=f"tokenizing ({fmt})",
        fn_kwargs={"tok": tok, "cfg": cfg, "split": split},
    )
    if tools:
        kw["fn_kwargs"]["tools"] = tools
    if len(ds) >= 2 * max(1, cfg.num_proc) and cfg.num_proc > 1:
        kw["num_proc"] = cfg.num_proc
    try:
        out = ds.map(fn, **kw)
    except DataError:
        raise
    except Exception as exc:  # datasets wraps worker errors; surface ours
        cause = exc
        while cause.__cause__ is not None and not isinstance(cause, DataError):
            cause = cause.__cause__
        if isinstance(cause, DataError):
            raise cause from None
        raise
    if fmt == "text":
        out = out.map(
            _pack,
            batched=True,
            fn_kwargs={"seq_len": cfg.seq_len},
            desc="packing",
            remove_columns=out.column_names,
        )
        return out, overlong.text_stats(len(ds), split, cfg.seq_len, len(out))
    # a preference pair or a prompt has no turn boundary to cut on: split drops it (reported so)
    whole = ("preference", "prompt", "unpaired")
    policy = "drop" if fmt in whole and cfg.overlong == "split" else cfg.overlong
    stats = overlong.count(out, split, fmt, policy, cfg.seq_len)
    out = out.filter(
        lambda fates: [f in overlong.KEPT for f in fates],
        batched=True,
        input_columns=overlong.FATE,
        desc="dropping over-long and empty",
    )
    out = out.remove_columns([overlong.FATE, overlong.TURNS])
    if fmt == "unpaired" and len(out):  # KTO's mismatched completions, of the examples kept
        out = unpaired.with_mismatched(out)
    return out, stats


def _text(batch, indices, tok, cfg, split):
    ids = tok(batch[cfg.text_field], add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    return {"ids": [x + [eos] for x in ids]}


def _pack(batch, seq_len):
    """Concatenate documents and cut fixed blocks; position_ids restart at each document so
    padding-free attention can keep documents apart."""
    ids, pos = [], []
    for doc in batch["ids"]:
        ids.extend(doc)
        pos.extend(range(len(doc)))
    n = len(ids) // seq_len * seq_len
    blocks = [ids[i : i + seq_len] for i in range(0, n, seq_len)]
    return {
        "input_ids": blocks,
        "labels": [list(b) for b in blocks],
        "position_ids": [pos[i : i + seq_len] for i in range(0, n, seq_len)],
    }


def _emit(out: dict, examples: list, fate: int, turns_left_out: int) -> None:
    """Append one record's rows: its examples (the first carries the record's fate, the others are
    PIECEs), or one empty placeholder row when it gave none, so that `overlong.count` sees it."""
    if not examples:
        examples, fate = (
            [([], [])],
            (
                overlong.EMPTY
                if fate == overlong.FIT
                else overlong.DROPPED
                if fate in (overlong.TRUNCATED, overlong.SPLIT)
                else fate
            ),
        )
    for i, (ids, labels) in enumerate(examples):
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out[overlong.FATE].append(fate if i == 0 else overlong.PIECE)
        out[overlong.TURNS].append(turns_left_out if i == 0 else 0)


def _rows() -> dict:
    return {"input_ids": [], "labels": [], overlong.FATE: [], overlong.TURNS: []}


def _prompt_completion(batch, indices, tok, cfg, split):
    out = _rows()
    rows = zip(indices, batch[cfg.prompt_field], batch[cfg.completion_field], strict=True)
    for i, (idx, p, c) in enumerate(rows):
        if not isinstance(p, str) or not isinstance(c, str):
            where = records.where(batch, i, idx, split)
            raise DataError(
                f"{where}: prompt/completion must be strings, got "
                f"{type(p).__name__}/{type(c).__name__}.",
                hint=f"check the '{cfg.prompt_field}' and '{cfg.completion_field}' columns",
            )
        p_ids = tok(p, add_special_tokens=True)["input_ids"]
        c_ids = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ex, fate = overlong.fit_prompt_completion(
            p_ids, c_ids, cfg.seq_len, cfg.overlong, tok.bos_token_id
        )
        _emit(out, [ex] if ex and overlong.trainable(ex[1]) else [], fate, 0)
    return out


def _messages(batch, indices, tok, cfg, split):
    """Render with the chat template; labels only on the characters of assistant turns."""
    if not getattr(tok, "chat_template", None):
        raise DataError(
            "data.format=messages needs a tokenizer with a chat template.",
            hint="use a chat model's tokenizer (model.tokenizer) or prompt/completion data",
        )
    out = _rows()
    encode = functools.partial(_encode_chat, tok=tok)
    for i, (idx, conv) in enumerate(zip(indices, batch[cfg.messages_field], strict=True)):
        problem = validate.chat_problem(conv) or validate.image_problem(conv)
        if problem:
            raise DataError(f"{records.where(batch, i, idx, split)}: {problem[0]}", hint=problem[1])
        examples, fate, left_out = overlong.fit_chat(conv, encode, cfg.seq_len, cfg.overlong)
        _emit(out, examples, fate, left_out)
    return out


def _encode_chat(conv: list, tok) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and, per token, the number of the assistant turn
    whose characters it covers (-1: not an assistant turn)."""
    text = tok.apply_chat_template(conv, tokenize=False)
    spans = []
    for i, m in enumerate(conv):
        if m["role"] == "assistant":
            start = (
                len(tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True))
                if i
                else 0
            )
            # What a template writes after the turn's end (ChatML's newline after <|im_end|>) is
            # layout, not the reply: the turn trains on its content and its end token only.
            end = len(tok.apply_chat_template(conv[: i + 1], tokenize=False).rstrip())
            spans.append((start, max(start, end)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    turn = [
        next((k for k, (s, e) in enumerate(spans) if s <= a and b <= e and b > a), -1)
        for a, b in enc["offset_mapping"]
    ]
    return enc["input_ids"], turn


# ------------------------------------------------------------------------------------- batching
class Collator:
    """Pad to the longest example, rounded up to `multiple` (tensor cores; fewer compile shapes).

    Padding is masked by position: labels -100 and attention_mask 0 wherever there is no token.
    """

    def __init__(
        self,
        pad_id: int,
        multiple: int = 64,
        max_len: int | None = None,
        position_ids: bool = False,
    ):
        self.pad_id, self.multiple, self.max_len, self.position_ids = (
            pad_id,
            multiple,
            max_len,
            position_ids,
        )

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        if self.position_ids and "position_ids" not in examples[0]:
            return self.pack(examples)
        longest = max(len(ex["input_ids"]) for ex in examples)
        width = -(-longest // self.multiple) * self.multiple
        if self.max_len:
            width = max(longest, min(width, self.max_len))
        n = len(examples)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, ex in enumerate(examples):
            k = len(ex["input_ids"])
            ids[i, :k] = torch.as_tensor(ex["input_ids"])
            labels[i, :k] = torch.as_tensor(ex["labels"])
            mask[i, :k] = 1
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if self.position_ids and "position_ids" in examples[0]:
            pos = torch.zeros((n, width), dtype=torch.long)
            for i, ex in enumerate(examples):
                pos[i, : len(ex["position_ids"])] = torch.as_tensor(ex["position_ids"])
            batch["position_ids"] = pos
        return batch

    def pack(self, examples: list[dict]) -> dict:
        """Padding-free: all examples end to end in one row, position_ids restarting at each, so
        attention keeps them apart and no compute goes to padding (only the row's tail is padded).
        """
        import torch

        ids, labels, pos = [], [], []
        for ex in examples:
            ids.extend(ex["input_ids"])
            # The previous example's last token must not learn to predict this one's first token.
            labels.extend([IGNORE] + list(ex["labels"][1:]))
            pos.extend(range(len(ex["input_ids"])))
        n = len(ids)
        width = -(-n // self.multiple) * self.multiple
        tail = width - n
        # The padded tail continues the last document's positions instead of starting one of its
        # own: no real token attends to it (it comes after all of them) and its labels are ignored,
        # so the loss is the same, and a row holding one document stays one document. A boundary
        # makes transformers build a (tokens x tokens) mask for sdpa/eager (4 GiB of bool and the
        # kernel's float copy at 64K tokens); without one, sdpa runs causal with no mask at all.
        last = pos[-1] + 1 if pos else 0
        batch = {
            "input_ids": torch.tensor([ids + [self.pad_id] * tail]),
            "labels": torch.tensor([labels + [IGNORE] * tail]),
            "attention_mask": torch.tensor([[1] * n + [0] * tail]),
            "position_ids": torch.tensor([pos + list(range(last, last + tail))]),
        }
        return batch


class BatchOrder:
    """Seeded, epoch-wise shuffled batches of indices that can start from any consumed count.

    The loop counts the batches it has *used* (workers may read ahead); resuming passes that count
    back as `start`, so the data position is exact whatever the prefetching.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world: int = 1,
    ):
        if n < batch_size:
            raise DataError(
                f"only {n} training examples for a micro-batch of {batch_size}.",
                hint="lower training.micro_batch_size or data.seq_len, or add data",
            )
        self.n, self.bs, self.seed, self.start, self.shuffle = n, batch_size, seed, start, shuffle
        self.per_epoch = (
            n // batch_size
        )  # drop the ragged tail: every micro-batch has the same size
        self.rows_per_epoch = n  # what an out-of-memory shrink converts positions over
        # Several processes share one global order round-robin (process r takes micro-batches
        # r, r+world, ...): together they see exactly the one-process batches. `start` is global.
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[list[int]]:
        import torch

        epoch, offset = divmod(self.start, self.per_epoch)
        while True:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.n, generator=g).tolist()
            else:
                order = list(range(self.n))
            for b in range(offset, self.per_epoch):
                if (epoch * self.per_epoch + b) % self.world == self.rank:
                    yield order[b * self.bs : (b + 1) * self.bs]
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:  # DataLoader asks; the order is endless
        return 2**62


def training_order(
    cfg, n: int, micro_batch_size: int, grad_accum: int, start: int = 0, rank: int = 0,
    world: int = 1,
):  # fmt: skip
    """The order a run's training examples are drawn in: BatchOrder, or for GRPO the prompts'
    GroupOrder (whole groups, whole steps, grpo.num_iterations repeats). Raises a DataError when
    there are too few examples for a micro-batch (GRPO: prompts for a step)."""
    t = cfg.training
    if t.objective != "grpo":
        return BatchOrder(n, micro_batch_size, t.seed, start=start, rank=rank, world=world)
    from onegpu.data.prompts import GroupOrder

    g = cfg.grpo
    per_step = micro_batch_size * grad_accum
    return GroupOrder(
        n, micro_batch_size, per_step, g.group_size, t.seed, start=start, repeat=g.num_iterations
    )


def make_loader(ds, order, collator, cfg: DataConfig, on_gpu: bool):
    from torch.utils.data import DataLoader

    if cfg.pin_memory and not on_gpu:  # page-locking only speeds up host-to-GPU copies
        log.info("data.pin_memory: no GPU, so batches stay in ordinary (pageable) memory")
    kw = dict(
        batch_sampler=order,
        collate_fn=collator,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and on_gpu,
    )
    if cfg.num_workers > 0:
        kw.update(prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers)
    return DataLoader(ds.with_format(None), **kw)


def eval_batches(ds, batch_size: int, collator, limit: int = 0):
    """Validation batches in fixed order (the same examples every evaluation)."""
    n = len(ds)
    count = -(-n // batch_size)
    if limit:
        count = min(count, limit)
    for b in range(count):
        rows = ds[b * batch_size : min(n, (b + 1) * batch_size)]
        yield collator(
            [dict(zip(rows, vals, strict=True)) for vals in zip(*rows.values(), strict=True)]
        )
