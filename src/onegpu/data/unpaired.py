"""Unpaired preference data (KTO): records of prompt + completion + label (True: desirable, False:
undesirable) -> token ids -> one batch per micro-batch holding the examples' sequences and, under
``kl_``-prefixed keys, the mismatched sequences KTO estimates its KL term from.

Records: ``prompt`` / ``completion`` / ``label`` as text (or chat messages, TRL's conversational
shape: the prompt a list of messages, the completion a list holding the assistant's message), or a
``messages`` conversation plus a label (its last message the completion). Preference pairs become
two records each (``unpair``: the chosen one desirable, the rejected one undesirable), as TRL's
``unpair_preference_dataset`` does.

Tokenizing is DPO's (pairs.encode_pair, TRL's rules); the mismatched completion of example i is
example i - 1's (the first takes the last's), TRL's rotation by one (KTOTrainer._prepare_dataset),
over the whole split rather than within each batch of a sequential sampler, so that the pairing
does not depend on the batch order and the reference log-probs of the mismatched sequences can be
computed once, before training.
"""

from __future__ import annotations

import dataclasses
import random

from onegpu.config import DataConfig
from onegpu.data import overlong, pairs, records
from onegpu.errors import DataError

IGNORE = overlong.IGNORE
EXAMPLE_INDEX, LABEL = "example_index", "label"
KL_IDS = "kl_completion_ids"
KL = "kl_"  # prefix of the mismatched sequences' batch keys
REF_COMPLETION, REF_KL = "ref_completion_logps", "ref_kl_logps"


# ------------------------------------------------------------------------------------ tokenizing
def tokenize_batch(batch, indices, tok, cfg: DataConfig, split: str) -> dict:
    """The `datasets.map` function batches.tokenize_counted applies to unpaired records: each
    record's ids, its label and its fate (fits, truncated, dropped; data/overlong.py)."""
    out = {"prompt_ids": [], "completion_ids": [], LABEL: [], overlong.FATE: [], overlong.TURNS: []}
    by_messages = cfg.completion_field not in batch
    completions = batch[cfg.messages_field if by_messages else cfg.completion_field]
    prompts = [None] * len(indices) if by_messages else batch.get(cfg.prompt_field)
    prompts = prompts or [None] * len(indices)
    # encode_pair's messages name the completion's column
    named = dataclasses.replace(
        cfg, chosen_field=cfg.completion_field, rejected_field=cfg.completion_field
    )
    if by_messages:
        named = dataclasses.replace(
            named, chosen_field=cfg.messages_field, rejected_field=cfg.messages_field
        )
    rows = zip(indices, prompts, completions, batch[cfg.label_field], strict=True)
    for i, (idx, p, c, label) in enumerate(rows):
        where = records.where(batch, i, idx, split)
        out[LABEL].append(_label(label, cfg.label_field, where))
        if pairs.empty_response(c):  # never trained on: counted as pairs' empty responses are
            fate, ids = overlong.EMPTY, ([], [])
        else:
            p_ids, c_ids, _ = pairs.encode_pair(p, c, c, tok, named, where)
            fate, (p_ids, c_ids, _) = pairs.fit_pair(
                p_ids, c_ids, c_ids, cfg.seq_len, cfg.overlong, tok.bos_token_id
            )
            ids = (p_ids, c_ids)
        out["prompt_ids"].append(ids[0])
        out["completion_ids"].append(ids[1])
        out[overlong.FATE].append(fate)
        out[overlong.TURNS].append(0)
    return out


def _label(value, field: str, where: str) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise DataError(
        f"{where}: '{field}' must be true (a desirable completion) or false (an undesirable one), "
        f"got {value!r}.",
        hint=f"give every record a boolean '{field}' (or set data.label_field)",
    )


def with_mismatched(ds):
    """The tokenized split plus each example's mismatched completion: example i - 1's."""
    completions = ds["completion_ids"]
    return ds.add_column(KL_IDS, completions[-1:] + completions[:-1])


def unpair(ds, prompt: str, chosen: str, rejected: str, seed: int):
    """Preference pairs -> unpaired records: each pair's chosen response desirable, its rejected
    one undesirable, in a seeded order (so that no example's mismatched completion, the one before
    it, is its own pair's other response)."""
    import datasets

    prompts = ds[prompt] if prompt in ds.column_names else [None] * len(ds)
    rows = [(p, c, True) for p, c in zip(prompts, ds[chosen], strict=True)]
    rows += [(p, r, False) for p, r in zip(prompts, ds[rejected], strict=True)]
    random.Random(seed).shuffle(rows)
    return datasets.Dataset.from_dict(
        {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "completion", "label"))}
    )


# ------------------------------------------------------------------------------------- batching
class UnpairedCollator:
    """n examples -> their n sequences (prompt + completion; only the completion is a target), with
    ``label`` and ``example_index`` (arange(n): the count in its shape, no device wait), and the n
    mismatched sequences (prompt i + completion i - 1) under ``kl_`` keys, their target positions
    computed here on the host (tokens.with_target_positions does the examples' own). A mismatched
    sequence longer than data.seq_len loses its completion's end. Precomputed reference log-probs
    travel as ``ref_logps``: the n examples', then the n mismatched sequences'."""

    reference_columns = (REF_COMPLETION, REF_KL)  # reference.precompute's two halves

    def __init__(self, collator, seq_len: int):
        self.collator, self.seq_len = collator, seq_len  # batches.Collator: padding/packing as SFT

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        from onegpu.objectives.tokens import with_target_positions

        batch = pairs.collate_sequences(self.collator, _sequences(examples, "completion_ids"))
        batch[EXAMPLE_INDEX] = torch.arange(len(examples))
        batch[LABEL] = torch.tensor([bool(ex[LABEL]) for ex in examples])
        if KL_IDS in examples[0]:
            kl = pairs.collate_sequences(self.collator, _sequences(examples, KL_IDS, self.seq_len))
            kl = with_target_positions(kl)
            kl[EXAMPLE_INDEX] = batch[EXAMPLE_INDEX]
            batch.update({KL + k: v for k, v in kl.items()})
        if REF_COMPLETION in examples[0]:
            batch[pairs.REF_LOGPS] = torch.tensor(
                [ex[REF_COMPLETION] for ex in examples] + [ex[REF_KL] for ex in examples],
                dtype=torch.float32,
            )
        return batch


def _sequences(examples: list[dict], key: str, seq_len: int = 0) -> list[dict]:
    seqs = []
    for ex in examples:
        p, resp = list(ex["prompt_ids"]), list(ex[key])
        if seq_len:
            resp = resp[: seq_len - len(p)]
        seqs.append({"input_ids": p + resp, "labels": [IGNORE] * len(p) + resp})
    return seqs


def mismatched(batch: dict) -> dict:
    """The batch of the mismatched sequences a KTO batch carries (its ``kl_`` keys)."""
    return {k[len(KL) :]: v for k, v in batch.items() if k.startswith(KL)}


def examples_of(batch: dict) -> dict:
    """A KTO batch without its mismatched sequences (what a forward over the examples reads)."""
    return {k: v for k, v in batch.items() if not k.startswith(KL)}
