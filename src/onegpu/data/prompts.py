"""Prompts for online RL (training.objective grpo): records with a ``prompt`` (text, or chat
messages as TRL's "conversational" shape) and any other columns, which the reward functions receive
by name.

Tokenizing follows TRL's GRPOTrainer: a chat prompt is rendered with the chat template and its
generation prompt, then tokenized without special tokens; a text prompt is tokenized as it is. A
prompt longer than data.seq_len is dropped (data.overlong split or drop: a prompt has no turn to cut
on) or cut from its start (truncate: the end, where the question is, is kept).

The order (``GroupOrder``) repeats each prompt ``group_size`` times in a row, so each step's rows
hold whole groups: micro-batches then count completions, as TRL's per-device batch does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from onegpu.config import DataConfig
from onegpu.data import overlong, records
from onegpu.errors import DataError

PROMPT_IDS, ROW = "prompt_ids", "_row"


def tokenize_batch(batch, indices, tok, cfg: DataConfig, split: str, tools=None) -> dict:
    """The `datasets.map` function for prompt records: each record's ids and fate; the record's own
    columns stay (the rewards read them). ``tools``: the JSON schemas of grpo.tools, rendered by
    the chat template into each chat prompt (TRL's GRPOTrainer passes its tools so)."""
    out = {PROMPT_IDS: [], ROW: list(indices), overlong.FATE: [], overlong.TURNS: []}
    for i, (idx, prompt) in enumerate(zip(indices, batch[cfg.prompt_field], strict=True)):
        where = records.where(batch, i, idx, split)
        ids = encode_prompt(prompt, tok, where, cfg.prompt_field, tools)
        fate = overlong.FIT if ids else overlong.EMPTY
        if len(ids) > cfg.seq_len:
            fate = overlong.TRUNCATED if cfg.overlong == "truncate" else overlong.DROPPED
            ids = ids[-cfg.seq_len :] if fate == overlong.TRUNCATED else ids
        out[PROMPT_IDS].append(ids)
        out[overlong.FATE].append(fate)
        out[overlong.TURNS].append(0)
    return out


def encode_prompt(prompt, tok, where: str, field: str = "prompt", tools=None) -> list[int]:
    """Token ids of one prompt: text, or a list of chat messages rendered by the chat template
    (with ``tools``, the tool schemas, when given)."""
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise DataError(
                f"{where}: '{field}' is a list but not of chat messages ({{role, content}}).",
                hint="give the prompt as text, or as a list of {role, content} messages",
            )
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{where}: chat-shaped prompts need a tokenizer with a chat template.",
                hint="use a chat model's tokenizer (model.tokenizer), or plain-text prompts",
            )
        text = tok.apply_chat_template(
            prompt, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        return tok(text, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, str) or not prompt:
        raise DataError(
            f"{where}: '{field}' must be non-empty text or chat messages, got {prompt!r:.60}.",
            hint=f"fill the '{field}' column of every record",
        )
    return tok(prompt)["input_ids"]


def completion_records(prompt, text: str):
    """A completion as TRL passes it to reward functions: text for a text prompt, a one-message
    list (the assistant's) for a chat prompt."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


class PromptCollator:
    """Rows of a prompt dataset as a batch: the prompt ids (a list per row, padded later, at
    generation) and every other column as a list, for the rewards."""

    def __call__(self, rows: list[dict]) -> dict:
        return {key: [row[key] for row in rows] for key in rows[0]}


class GroupOrder:
    """Seeded, epoch-wise shuffled micro-batches of prompt indices, each prompt ``group`` times in a
    row, ``repeat`` times per step (grpo.num_iterations: the same rollouts serve several steps).

    Each epoch uses a whole number of steps' prompts, so no group or step straddles two epochs,
    and as with BatchOrder the order of an epoch does not depend on the micro-batch size: after an
    out-of-memory retry halves it, the same position holds the same rows.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        per_step: int,
        group: int,
        seed: int,
        start: int = 0,
        repeat: int = 1,
    ):
        prompts_per_step = per_step // group
        if n < prompts_per_step:
            raise DataError(
                f"only {n} training prompts for a step of {prompts_per_step} prompts x "
                f"{group} completions.",
                hint="lower training.micro_batch_size or training.grad_accum, or add prompts",
            )
        self.n, self.bs, self.seed, self.start = n, batch_size, seed, start
        self.group, self.repeat, self.step_prompts = group, repeat, prompts_per_step
        self.steps_per_epoch = n // prompts_per_step
        self.rows_per_epoch = self.steps_per_epoch * per_step * repeat
        self.per_epoch = self.rows_per_epoch // batch_size

    def __iter__(self) -> Iterator[list[int]]:
        import torch

        epoch, offset = divmod(self.start, self.per_epoch)
        while True:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
            rows = []
            for s in range(self.steps_per_epoch):
                step = order[s * self.step_prompts : (s + 1) * self.step_prompts]
                rows += [i for i in step for _ in range(self.group)] * self.repeat
            for b in range(offset, self.per_epoch):
                yield rows[b * self.bs : (b + 1) * self.bs]
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:  # DataLoader asks; the order is endless
        return 2**62


# ------------------------------------------------------------------------------ the default job
def corpus_prompts(ds, text_field: str, seed: int, count: int, lines: int = 6):
    """The default job's prompts: the first ``lines`` lines of a function or class of the standard
    library (a `def` or `class` line and what follows it), to be continued into Python that
    compiles (rewards.python_continues)."""
    import datasets

    rng = random.Random(seed)
    out: list[str] = []
    for text in ds[text_field]:
        src = text.splitlines()
        starts = [i for i, line in enumerate(src) if line.lstrip().startswith(("def ", "class "))]
        rng.shuffle(starts)
        for i in starts[:8]:
            head = "\n".join(src[i : i + lines]).rstrip() + "\n"
            if head.strip() and len(head) < 400:
                out.append(head)
        if len(out) >= count:
            break
    if not out:
        raise DataError("no function or class found in the corpus to make prompts from.")
    rng.shuffle(out)
    return datasets.Dataset.from_dict({"prompt": out[: max(count, 1)]})
