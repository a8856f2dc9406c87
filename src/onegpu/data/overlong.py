"""Records longer than data.seq_len: truncate, drop or split them (DataConfig.overlong), and count
what happened so a run says how much of its data it did not train on.

Each tokenized row carries its record's fate (`FATE` column; further pieces of a split record are
`PIECE`) and the assistant turns it left out (`TURNS`), so the counts survive `datasets.map` with
several processes and its cache; `count` reads them back and `tokenize` then drops the columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

IGNORE = -100
FATE, TURNS = "_fate", "_turns_left_out"
# BAD: a record left out under data.on_bad_record=skip (an image missing or unreadable)
FIT, TRUNCATED, DROPPED, SPLIT, PIECE, EMPTY, BAD = range(7)
KEPT = (FIT, TRUNCATED, SPLIT, PIECE)

Example = tuple[list[int], list[int]]  # (input_ids, labels)


@dataclass
class DataStats:
    """What tokenizing one split did to its records."""

    split: str  # "train" | "validation"
    fmt: str  # text | prompt_completion | messages
    policy: str  # data.overlong
    seq_len: int
    records: int = 0
    examples: int = 0
    overlong: int = 0  # records longer than seq_len
    truncated: int = 0  # kept, cut at seq_len
    split_records: int = 0  # cut on turn boundaries into several examples
    split_examples: int = 0  # the examples those became
    dropped: int = 0  # over-long records that gave no example
    turns_left_out: int = 0  # assistant turns longer than seq_len on their own (split)
    empty: int = 0  # records with nothing to train on (no assistant turn, an empty response)
    bad: int = 0  # records skipped for an image that is missing or unreadable (on_bad_record=skip)

    def describe(self) -> str:
        """One line: how many of how many, and the policy."""
        if self.fmt == "text":
            return (
                f"{self.split}: 0 of {self.records:,} records cut (raw text is packed into "
                f"{self.seq_len}-token blocks: nothing is lost)"
            )
        line = (
            f"{self.split}: {self.overlong:,} of {self.records:,} records longer than data.seq_len="
            f"{self.seq_len} (data.overlong={self.policy})"
        )
        parts = []
        if self.split_records:
            parts.append(
                f"{self.split_records:,} split on turn boundaries into {self.split_examples:,} "
                "examples"
            )
        if self.truncated:
            parts.append(f"{self.truncated:,} truncated (a cut assistant turn is not trained on)")
        if self.dropped:
            parts.append(f"{self.dropped:,} dropped")
        if self.turns_left_out:
            parts.append(
                f"{self.turns_left_out:,} assistant turn(s) longer than seq_len on their own left "
                "out"
            )
        if self.empty and self.fmt == "preference":
            parts.append(
                f"{self.empty:,} pair(s) with an empty chosen or rejected response dropped"
            )
        elif self.empty:
            parts.append(f"{self.empty:,} other record(s) with nothing to train on skipped")
        if self.bad:
            parts.append(
                f"{self.bad:,} record(s) with a missing or unreadable image skipped "
                "(data.on_bad_record=skip)"
            )
        return line + (": " + ", ".join(parts) if parts else "")


def count(ds, split: str, fmt: str, policy: str, seq_len: int) -> DataStats:
    """Read the fate columns of a tokenized (not yet filtered) split."""
    import numpy as np

    fates = np.asarray(ds.data.column(FATE).to_numpy(), dtype=np.int64)
    by = np.bincount(fates, minlength=7)
    turns = int(np.asarray(ds.data.column(TURNS).to_numpy()).sum()) if len(fates) else 0
    return DataStats(
        split,
        fmt,
        policy,
        seq_len,
        records=int(len(fates) - by[PIECE]),
        examples=int(sum(by[k] for k in KEPT)),
        overlong=int(by[TRUNCATED] + by[SPLIT] + by[DROPPED]),
        truncated=int(by[TRUNCATED]),
        split_records=int(by[SPLIT]),
        split_examples=int(by[SPLIT] + by[PIECE]),
        dropped=int(by[DROPPED]),
        turns_left_out=turns,
        empty=int(by[EMPTY]),
        bad=int(by[BAD]),
    )


def text_stats(records: int, split: str, seq_len: int, examples: int) -> DataStats:
    return DataStats(split, "text", "packed", seq_len, records=records, examples=examples)


def trainable(labels: list[int]) -> bool:
    # labels[0] is never a target (the loss predicts token i+1 from token i)
    return any(t != IGNORE for t in labels[1:])


# -------------------------------------------------------------------------------- prompt/completion
def fit_prompt_completion(
    p_ids: list[int], c_ids: list[int], seq_len: int, policy: str, bos: int | None
) -> tuple[Example | None, int]:
    """One example (or None) and the record's fate. The completion (ending in EOS) is never cut:
    truncate cuts the prompt from its start, keeping a leading BOS and the text next to the
    completion."""
    if len(p_ids) + len(c_ids) <= seq_len:
        return (p_ids + c_ids, [IGNORE] * len(p_ids) + c_ids), FIT
    if policy != "truncate":
        return None, DROPPED  # split: a prompt/completion record has no turn boundary to cut on
    lead = 1 if p_ids and bos is not None and p_ids[0] == bos else 0
    room = seq_len - len(c_ids) - lead
    if room < 1:
        return None, DROPPED
    kept = p_ids[:lead] + p_ids[len(p_ids) - room :]
    return (kept + c_ids, [IGNORE] * len(kept) + c_ids), TRUNCATED


# ---------------------------------------------------------------------------------------- chat
# encode(conversation) -> (input_ids, turn): per token, the index of the assistant turn it belongs
# to, or -1 for tokens that are never trained on.
Encode = Callable[[list], tuple[list[int], list[int]]]


def labelled(ids: list[int], turn: list[int], cut: frozenset = frozenset()) -> list[int]:
    """Labels on assistant tokens, except those of the turns in `cut`."""
    return [t if k >= 0 and k not in cut else IGNORE for t, k in zip(ids, turn, strict=True)]


def fit_chat(
    conv: list, encode: Encode, seq_len: int, policy: str
) -> tuple[list[Example], int, int]:
    """(examples, fate, assistant turns left out) for one conversation."""
    ids, turn = encode(conv)
    if len(ids) <= seq_len:
        labels = labelled(ids, turn)
        return ([(ids, labels)], FIT, 0) if trainable(labels) else ([], EMPTY, 0)
    if policy == "drop":
        return [], DROPPED, 0
    if policy == "truncate":
        # The turn the cut falls in lost its end (and its EOS): none of it is a target, or the
        # model would learn to stop mid-answer. Turns wholly before the cut keep their labels.
        cut = frozenset(k for k in turn[seq_len:] if k >= 0)
        labels = labelled(ids[:seq_len], turn[:seq_len], cut)
        return ([(ids[:seq_len], labels)], TRUNCATED, 0) if trainable(labels) else ([], DROPPED, 0)
    examples, left_out = split_chat(conv, encode, seq_len)
    return examples, (SPLIT if examples else DROPPED), left_out


def split_chat(conv: list, encode: Encode, seq_len: int) -> tuple[list[Example], int]:
    """Cut a conversation on turn boundaries into examples of <= seq_len tokens.

    Each example is the leading system message(s) (dropped from an example only when they leave no
    room for a turn) plus as many consecutive exchanges as fit, where an exchange runs from a user
    message to the end of the assistant's answer (tool calls and results included), so every
    assistant turn is whole and ends with its EOS. An exchange longer than seq_len on its own is
    left out; the count of its assistant turns is returned.
    """
    n_ctx = 0
    while n_ctx < len(conv) and conv[n_ctx]["role"] == "system":
        n_ctx += 1
    ctx = conv[:n_ctx]
    # cut after an assistant message that a user message (or the end) follows
    cuts = [
        i + 1
        for i in range(n_ctx, len(conv))
        if conv[i]["role"] == "assistant" and (i + 1 == len(conv) or conv[i + 1]["role"] == "user")
    ]
    examples: list[Example] = []
    left_out, start = 0, n_ctx
    for first in range(len(cuts)):
        if cuts[first] <= start:
            continue
        best = None
        for prefix in (ctx, []) if ctx else ([],):
            for end in cuts[first:]:
                ids, turn = encode(prefix + conv[start:end])
                if len(ids) > seq_len:
                    break
                best = (end, ids, turn)
            if best:
                break
        if best is None:  # this exchange alone does not fit
            end = cuts[first]
            left_out += sum(m["role"] == "assistant" for m in conv[start:end])
            start = end
            continue
        end, ids, turn = best
        labels = labelled(ids, turn)
        if trainable(labels):
            examples.append((ids, labels))
        start = end
    return examples, left_out
