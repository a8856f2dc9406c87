"""Preference pairs: records of prompt + chosen + rejected -> token ids -> one batch per micro-batch
in which every chosen sequence and every rejected one is a row of a single forward.

Records: ``prompt`` / ``chosen`` / ``rejected`` as plain text, or as chat messages (TRL's
"conversational" shape: the prompt a list of messages, each response a list holding the assistant's
message; a prompt given as text becomes one user message). Without a prompt column, chat responses
that are whole conversations share their prompt as their common leading messages.

Tokenizing follows TRL's DPOTrainer, so that both train on the same tokens: the prompt (with the
chat template's generation prompt), and prompt + response as one text (plain responses end in EOS);
the response starts where the two token sequences part. Only response tokens are targets.
"""

from __future__ import annotations

import random
import re

from onegpu.config import DataConfig
from onegpu.data import overlong, records, validate
from onegpu.errors import DataError

IGNORE = overlong.IGNORE
SEQUENCE_IDS, PAIR_INDEX, REF_LOGPS = "sequence_ids", "pair_index", "ref_logps"
REF_CHOSEN, REF_REJECTED = "ref_chosen_logps", "ref_rejected_logps"
MARGIN = "margin"


# ------------------------------------------------------------------------------------ tokenizing
def tokenize_batch(batch, indices, tok, cfg: DataConfig, split: str) -> dict:
    """The `datasets.map` function batches.tokenize_counted applies to preference records: each
    record's ids and its fate (fits, truncated, dropped; data/overlong.py)."""
    out = {
        "prompt_ids": [],
        "chosen_ids": [],
        "rejected_ids": [],
        overlong.FATE: [],
        overlong.TURNS: [],
    }
    prompts = batch.get(cfg.prompt_field) or [None] * len(indices)
    rows = zip(indices, prompts, batch[cfg.chosen_field], batch[cfg.rejected_field], strict=True)
    for i, (idx, p, c, r) in enumerate(rows):
        where = records.where(batch, i, idx, split)
        if empty_response(c) or empty_response(r):
            # An empty response still tokenizes (to its EOS), so it would be trained on: a pair
            # that prefers "nothing" to an answer, or an answer to "nothing", is left out and
            # counted (DataStats.empty), as over-long pairs are.
            fate, (prompt_ids, chosen_ids, rejected_ids) = overlong.EMPTY, ([], [], [])
        else:
            prompt_ids, chosen_ids, rejected_ids = encode_pair(p, c, r, tok, cfg, where)
            fate, (prompt_ids, chosen_ids, rejected_ids) = fit_pair(
                prompt_ids, chosen_ids, rejected_ids, cfg.seq_len, cfg.overlong, tok.bos_token_id
            )
        out["prompt_ids"].append(prompt_ids)
        out["chosen_ids"].append(chosen_ids)
        out["rejected_ids"].append(rejected_ids)
        out[overlong.FATE].append(fate)
        out[overlong.TURNS].append(0)
    if cfg.margin_field in batch:  # reward models read it (TRL's RewardTrainer's margin)
        out[MARGIN] = [float(m) for m in batch[cfg.margin_field]]
    return out


def empty_response(value) -> bool:
    """A response with no text: an empty (or blank) string, or chat messages whose last one, the
    answer, has empty text content."""
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        content = value[-1].get("content")
        return isinstance(content, str) and not content.strip()
    return False


def encode_pair(
    prompt, chosen, rejected, tok, cfg: DataConfig, where: str
) -> tuple[list, list, list]:
    """Token ids of (prompt, chosen response, rejected response) of one record."""
    chat = any(isinstance(x, list) for x in (prompt, chosen, rejected))
    if chat:
        prompt, chosen, rejected = _as_messages(prompt, chosen, rejected, cfg, where)
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{where}: chat-shaped preference data needs a tokenizer with a chat template.",
                hint="use a chat model's tokenizer (model.tokenizer), or plain-text "
                "prompt/chosen/rejected",
            )

        def render(messages, generation_prompt=False):
            text = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            return tok(text, add_special_tokens=False)["input_ids"]

        p_ids, pc, pr = render(prompt, True), render(prompt + chosen), render(prompt + rejected)
    else:
        for name, value in (
            (cfg.prompt_field, prompt),
            (cfg.chosen_field, chosen),
            (cfg.rejected_field, rejected),
        ):
            if value is None:
                raise DataError(
                    f"{where}: the record has no '{name}'.",
                    hint=f"give every preference record a '{name}' "
                    "(text or a list of chat messages)",
                )
            if not isinstance(value, str):
                raise DataError(
                    f"{where}: '{name}' must be text or a list of chat messages, got "
                    f"{type(value).__name__}.",
                    hint=f"check the '{name}' column",
                )
        eos = tok.eos_token or ""
        p_ids = tok(prompt)["input_ids"]
        pc = tok(prompt + chosen + ("" if chosen.endswith(eos) else eos))["input_ids"]
        pr = tok(prompt + rejected + ("" if rejected.endswith(eos) else eos))["input_ids"]
    start = min(_common_prefix(p_ids, pc), _common_prefix(p_ids, pr))
    return p_ids[:start], pc[start:], pr[start:]


def _as_messages(prompt, chosen, rejected, cfg: DataConfig, where: str) -> tuple[list, list, list]:
    def msgs(value, role, name):
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        problem = validate.chat_problem(value)
        if problem:
            raise DataError(f"{where}, '{name}': {problem[0]}", hint=problem[1])
        return list(value)

    chosen = msgs(chosen, "assistant", cfg.chosen_field)
    rejected = msgs(rejected, "assistant", cfg.rejected_field)
    if prompt is None:  # implicit prompt: the messages both conversations share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        return chosen[:n], chosen[n:], rejected[n:]
    return msgs(prompt, "user", cfg.prompt_field), chosen, rejected


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fit_pair(p_ids: list, c_ids: list, r_ids: list, seq_len: int, policy: str, bos: int | None):
    """(fate, (prompt, chosen, rejected)) within seq_len per sequence. truncate: the prompt loses
    its start (a leading BOS kept) down to half of seq_len, then the responses their ends;
    drop/split: left out."""
    if not c_ids or not r_ids:
        return overlong.EMPTY, ([], [], [])
    if len(p_ids) + max(len(c_ids), len(r_ids)) <= seq_len:
        return overlong.FIT, (p_ids, c_ids, r_ids)
    if policy != "truncate":
        return overlong.DROPPED, ([], [], [])
    lead = 1 if p_ids and bos is not None and p_ids[0] == bos else 0
    keep = max(min(len(p_ids), seq_len // 2), seq_len - max(len(c_ids), len(r_ids)))
    if keep < len(p_ids):
        p_ids = p_ids[:lead] + p_ids[len(p_ids) - (keep - lead) :] if keep > lead else p_ids[:keep]
    room = seq_len - len(p_ids)
    return overlong.TRUNCATED, (p_ids, c_ids[:room], r_ids[:room])


# ------------------------------------------------------------------------------------- batching
class PairCollator:
    """n pairs -> 2n sequences (all chosen, then all rejected) in one batch for a single forward.

    ``sequence_ids`` gives each token's sequence (-1: padding), so the per-sequence sums work the
    same for padded rows and for one padding-free packed row; ``pair_index`` (arange(n)) carries the
    pair count in its shape, so nothing waits on the device to know it. Precomputed reference
    log-probs travel as ``ref_logps`` in the same order as the sequences.
    """

    reference_columns = (REF_CHOSEN, REF_REJECTED)  # reference.precompute's two halves

    def __init__(self, collator, shared: bool = False):
        self.collator = collator  # batches.Collator: padding/packing as for SFT
        # a reward model's shared-prompt rows (objectives/shared_prompt.py), described beside the
        # two-row batch: the objective takes them where its model can
        self.shared = shared

    def __call__(self, examples: list[dict]) -> dict:
        import torch

        seqs = []
        for key in ("chosen_ids", "rejected_ids"):
            for ex in examples:
                p, resp = list(ex["prompt_ids"]), list(ex[key])
                seqs.append({"input_ids": p + resp, "labels": [IGNORE] * len(p) + resp})
        batch = collate_sequences(self.collator, seqs)
        batch[PAIR_INDEX] = torch.arange(len(examples))
        if self.shared and batch["input_ids"].size(0) == len(seqs):
            from onegpu.objectives import shared_prompt

            batch.update(
                shared_prompt.layout(
                    [len(ex["prompt_ids"]) for ex in examples],
                    [len(ex["chosen_ids"]) for ex in examples],
                    [len(ex["rejected_ids"]) for ex in examples],
                    batch["input_ids"].size(1),
                    getattr(self.collator, "multiple", 1),
                )
            )
        if MARGIN in examples[0]:
            batch[MARGIN] = torch.tensor([ex[MARGIN] for ex in examples], dtype=torch.float32)
        if REF_CHOSEN in examples[0]:
            batch[REF_LOGPS] = torch.tensor(
                [ex[REF_CHOSEN] for ex in examples] + [ex[REF_REJECTED] for ex in examples],
                dtype=torch.float32,
            )
        return batch


def collate_sequences(collator, seqs: list[dict]) -> dict:
    """``seqs`` (input_ids, labels) as one batch, padded or packed by ``collator``, with each
    token's sequence in ``sequence_ids`` (-1: padding)."""
    import torch

    batch = collator(seqs)
    lengths = [len(s["input_ids"]) for s in seqs]
    ids = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    if batch["input_ids"].size(0) == len(seqs):  # one row per sequence
        for i, k in enumerate(lengths):
            ids[i, :k] = i
    else:  # packed end to end in one row
        ids[0, : sum(lengths)] = torch.repeat_interleave(
            torch.arange(len(seqs)), torch.tensor(lengths)
        )
    batch[SEQUENCE_IDS] = ids
    return batch


# ----------------------------------------------------------------------------- the default pairs
def corpus_pairs(
    ds, text_field: str, seed: int, limit: int = 0, prompt_lines: int = 6, response_lines: int = 4
):
    """Preference pairs from source files, for the default job: a run of lines is the prompt, the
    lines that really follow are chosen, the same lines with their words shuffled (indentation and
    line breaks kept) rejected. The model must learn what code looks like to prefer the real one.
    At most ``limit`` pairs (0: all), a seeded sample of all of them."""
    import datasets

    rng = random.Random(seed)
    rows = []
    span = prompt_lines + response_lines
    for text in ds[text_field]:
        lines = [ln for ln in (text or "").splitlines() if ln.strip()]
        for start in range(0, len(lines) - span + 1, span):
            chosen = "\n".join(lines[start + prompt_lines : start + span]) + "\n"
            rejected = _shuffle_words(chosen, rng)
            if rejected == chosen:
                continue
            rows.append(("\n".join(lines[start : start + prompt_lines]) + "\n", chosen, rejected))
    rng.shuffle(rows)  # a sample of every file, not the first files' pairs alone
    rows = rows[:limit] if limit else rows
    return datasets.Dataset.from_dict(
        {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
    )


def _shuffle_words(text: str, rng: random.Random) -> str:
    words = re.findall(r"\S+", text)
    rng.shuffle(words)
    it = iter(words)
    return re.sub(r"\S+", lambda _m: next(it), text)
