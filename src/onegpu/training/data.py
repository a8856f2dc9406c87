"""A run's data, built once and typed: tokenizer, tokenized splits, collator, detected format."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from onegpu import models, report
from onegpu.config import Config
from onegpu.data import batches
from onegpu.data import records as records_io
from onegpu.data.overlong import DataStats
from onegpu.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Records:
    """The records as read (before tokenizing), with their detected format."""

    train: Any  # datasets.Dataset
    val: Any  # datasets.Dataset or None
    fingerprint: str
    format: str  # text | prompt-completion | chat | preference: detected from the columns


@dataclass(frozen=True)
class Data:
    """Everything the loop, evaluation and checkpoints need of the data."""

    tokenizer: Any
    train_ds: Any  # tokenized training split (datasets.Dataset)
    val_ds: Any  # tokenized validation split, or None
    collator: Any  # batches.Collator (or pairs.PairCollator for preference pairs)
    format: str  # text | prompt-completion | chat | preference: detected from the columns
    stats: list[DataStats] = field(default_factory=list)  # per split: records cut, dropped, split
    sample_prompt: str | None = None  # a prompt from the data, for the end-of-run generate hint
    processor: Any = (
        None  # a vision-language model's processor (saved beside its weights); text: None
    )


def read_records(cfg: Config) -> Records:
    """The configured records (or the default job's corpus, made into pairs for a preference
    objective), checked against the objective."""
    objective = cfg.training.objective
    if cfg.data.path is None and cfg.data.corpus in ("edits", "copy"):
        from onegpu.data.copy_task import copy_tasks
        from onegpu.data.edits import edit_records, edit_tasks

        make = copy_tasks if cfg.data.corpus == "copy" else edit_tasks
        return Records(*edit_records(cfg.data, cfg.training, make), "prompt_completion")
    train_rec, val_rec, fingerprint = records_io.load_records(cfg.data, cfg.training.seed)
    if objective == "grpo" and cfg.data.path is None:
        train_rec, val_rec = corpus_prompts(cfg, train_rec, val_rec)
    elif objective != "sft" and cfg.data.path is None:
        train_rec, val_rec = corpus_pairs(cfg, train_rec, val_rec)
    if objective == "grpo":  # prompts, with whatever other columns the rewards read
        return Records(train_rec, val_rec, fingerprint, check_prompts(cfg, train_rec, val_rec))
    columns = train_rec.column_names
    fmt = records_io.detect_format(cfg.data, columns)
    if fmt == "unpaired" and objective != "kto" and cfg.data.format == "auto":
        # a label column means KTO's records only to KTO: other objectives read the rest
        fmt = records_io.detect_format(cfg.data, [c for c in columns if c != cfg.data.label_field])
    check_objective(cfg, fmt, train_rec.column_names)
    if objective == "kto" and fmt == "preference":  # each pair: a desirable, an undesirable example
        train_rec, val_rec = (
            _unpaired(cfg, rec, seed) for rec, seed in ((train_rec, 0), (val_rec, 1))
        )
        fmt = "unpaired"
    return Records(train_rec, val_rec, fingerprint, fmt)


def _unpaired(cfg: Config, rec, seed: int):
    from onegpu.data.unpaired import unpair

    if rec is None:
        return None
    d = cfg.data
    out = unpair(rec, d.prompt_field, d.chosen_field, d.rejected_field, cfg.training.seed + seed)
    # unpair names its columns prompt / completion / label: read them under those names
    return out.rename_columns(
        {
            k: v
            for k, v in (
                ("prompt", d.prompt_field),
                ("completion", d.completion_field),
                ("label", d.label_field),
            )
            if k != v
        }
    )


def build_data(cfg: Config, model_name: str, recs: Records | None = None) -> Data:
    """Tokenizer, tokenized splits and collator of the run (``recs``: read already, else here)."""
    recs = recs if recs is not None else read_records(cfg)
    if models.is_vision_model(model_name, cfg.model.trust_remote_code):
        return build_vision_data(cfg, model_name, recs)
    train_rec, val_rec, fmt = recs.train, recs.val, recs.format
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(cfg, model_name, train_rec, fmt, recs.fingerprint)
    check_positions(cfg, model_name)  # before tokenizing: a too long seq_len is not "no examples"
    tools = tool_schemas(cfg)
    train_ds, stats = batches.tokenize_counted(train_rec, fmt, tokenizer, cfg.data, "train", tools)
    all_stats = [stats]
    val_ds = None
    if val_rec is not None:
        val_ds, stats = batches.tokenize_counted(
            val_rec, fmt, tokenizer, cfg.data, "validation", tools
        )
        all_stats.append(stats)
    for stats in all_stats:
        log.info("data %s", stats.describe())
    _warn_without_validation(cfg.data, fmt, len(train_rec), val_rec, val_ds, all_stats[-1])
    if len(train_ds) == 0:
        train = all_stats[0]
        if train.overlong:  # the policy left nothing: say so, with the counts
            raise DataError(
                f"no training examples after tokenization: {train.describe()}.",
                hint="raise data.seq_len (up to the model's limit), or choose another "
                "data.overlong",
            )
        raise DataError(
            "no training examples after tokenization (all records too short or fully masked).",
            hint="lower data.seq_len or check the data",
        )
    collator = batches.Collator(
        tokenizer.pad_token_id,
        cfg.data.pad_to_multiple,
        cfg.data.seq_len,
        position_ids=cfg.techniques.padding_free,
    )
    if fmt == "preference":  # each pair: its chosen and rejected sequences in the one batch
        from onegpu.data.pairs import PairCollator

        shared = cfg.training.objective == "reward" and cfg.techniques.shared_prompt != "off"
        collator = PairCollator(collator, shared=shared)
    if fmt == "unpaired":  # KTO: the examples and their mismatched sequences
        from onegpu.data.unpaired import UnpairedCollator

        collator = UnpairedCollator(collator, cfg.data.seq_len)
    if fmt == "prompt":  # GRPO: prompt ids and the columns; rollouts are padded when sampled
        from onegpu.data.prompts import PromptCollator

        collator = PromptCollator()
    sample = report.sample_prompt(val_rec if val_rec is not None else train_rec, fmt, cfg.data)
    log.info(
        "data: %s, %d train / %d val examples of <= %d tokens (%.1fs)",
        fmt,
        len(train_ds),
        len(val_ds or []),
        cfg.data.seq_len,
        time.perf_counter() - t0,
    )
    return Data(tokenizer, train_ds, val_ds, collator, fmt, all_stats, sample)


def tool_schemas(cfg: Config) -> list | None:
    """GRPO's tools as the chat template shows them (objectives/tools.schemas); None without."""
    if cfg.training.objective != "grpo" or not cfg.grpo.tools:
        return None
    from onegpu.objectives.tools import schemas

    return schemas(cfg.grpo.tools)


def build_vision_data(cfg: Config, model_name: str, recs: Records) -> Data:
    """A vision-language model's data: chat records with images, tokenized by its processor
    (data/vision.py), batched with their pixel values."""
    from onegpu import vlm
    from onegpu.data import vision

    if recs.format != "messages" or cfg.training.objective != "sft":
        raise DataError(
            f"a vision-language model trains on chat records ('{cfg.data.messages_field}' with "
            f"image parts) with training.objective=sft; got {recs.format} records and "
            f"objective {cfg.training.objective}.",
            hint='write the records as messages with {"type": "image"} parts (docs/vlm.md)',
        )
    processor = vlm.load_processor(model_name, cfg.model.trust_remote_code)
    models.ensure_pad_token(processor.tokenizer)
    vision.announce(cfg.data)
    if cfg.techniques.padding_free:
        log.info("techniques.padding_free: off for a vision-language model (rows stay padded)")
    t0 = time.perf_counter()
    splits = [(recs.train, "train"), (recs.val, "validation")]
    done = [
        vision.tokenize_counted(r, processor, cfg.data, name) for r, name in splits if r is not None
    ]
    stats = [s for _, s in done]
    for st in stats:
        log.info("data %s", st.describe())
    train_ds, val_ds = done[0][0], done[1][0] if len(done) > 1 else None
    if len(train_ds) == 0:
        raise DataError(
            f"no training examples after tokenization: {stats[0].describe()}.",
            hint="raise data.seq_len, lower data.max_pixels / data.image_size, or fix the images",
        )
    log.info(
        "data: messages with images, %d train / %d val examples of <= %d tokens (%.1fs)",
        len(train_ds),
        len(val_ds or []),
        cfg.data.seq_len,
        time.perf_counter() - t0,
    )
    collator = vision.VisionCollator(processor, cfg.data)
    return Data(processor.tokenizer, train_ds, val_ds, collator, "messages", stats, None, processor)


def _warn_without_validation(d, fmt: str, n_train: int, val_rec, val_ds, stats) -> None:
    """Data that yields no validation example makes every evaluation print 'val loss n/a': say
    so once, at the start, with why and the fix (data.val_fraction 0 asks for it: no warning)."""
    if d.val_fraction <= 0 or (val_ds is not None and len(val_ds)):
        return
    if val_rec is None or len(val_rec) == 0:
        one = " (a text file is one record)" if fmt == "text" else ""
        why = (
            f"{n_train} record(s) in the data{one}, too few to hold data.val_fraction="
            f"{d.val_fraction} of them out"
        )
        fix = (
            "give more records (a folder of several files holds whole files out), or set "
            "data.val_fraction 0 to train without validation"
        )
    elif fmt == "text":
        why = f"the {len(val_rec)} held-out record(s) fill no whole {d.seq_len}-token block"
        fix = "raise data.val_fraction, or lower data.seq_len"
    else:
        why = f"all {len(val_rec)} held-out record(s) were left out ({stats.describe()})"
        fix = "raise data.val_fraction, or data.seq_len / data.overlong so they fit"
    log.warning(
        "no validation examples: %s; the run reports no validation loss (val loss n/a). fix: %s",
        why,
        fix,
    )


def build_tokenizer(cfg: Config, model_name: str, train_records, fmt: str, fingerprint: str):
    """Presets get a byte-level BPE trained on the training split; everything else its own
    tokenizer."""
    mcfg = cfg.model
    trained = not mcfg.tokenizer and models.is_preset(model_name)
    if mcfg.split_digits and not trained:
        # an existing tokenizer keeps its own pre-tokenizer: the switch would do nothing
        raise ConfigError(
            "model.split_digits applies only to the tokenizer trained for a preset model "
            f"(model {model_name!r}, model.tokenizer {mcfg.tokenizer!r}).",
            hint="drop model.split_digits, or train a preset (model.name tiny/small/...) "
            "without model.tokenizer",
        )
    if mcfg.tokenizer:
        return models.load_tokenizer(mcfg.tokenizer, mcfg.trust_remote_code)
    if not models.is_preset(model_name):
        return models.load_tokenizer(model_name, mcfg.trust_remote_code)
    from onegpu.data.tokenizer import train_tokenizer

    texts = records_io.corpus_texts(train_records, fmt, cfg.data)
    return train_tokenizer(texts, mcfg.vocab_size, fingerprint, mcfg.split_digits)


def corpus_pairs(cfg: Config, train_rec, val_rec):
    """The default job's preference pairs, made from the standard library's sources (data/pairs.py),
    as many as the run will use: DPO's reference pass then costs no more."""
    from onegpu.data.pairs import corpus_pairs as make

    t = cfg.training
    train = make(
        train_rec, cfg.data.text_field, t.seed, t.max_steps * t.micro_batch_size * t.grad_accum
    )
    val = (
        make(val_rec, cfg.data.text_field, t.seed, max(t.eval_batches, 1) * t.micro_batch_size)
        if val_rec is not None
        else None
    )
    return train, val


def corpus_prompts(cfg: Config, train_rec, val_rec):
    """The default GRPO job's prompts: the starts of standard-library functions and classes
    (data/prompts.corpus_prompts), as many as the run uses."""
    from onegpu.data.prompts import corpus_prompts as make

    t, g = cfg.training, cfg.grpo
    per_step = t.micro_batch_size * t.grad_accum // g.group_size
    field = cfg.data.text_field
    train = make(train_rec, field, t.seed, max(per_step * t.max_steps, per_step))
    val = None
    if val_rec is not None:
        val = make(
            val_rec,
            field,
            t.seed + 1,
            max(t.eval_batches, 1) * max(1, t.micro_batch_size // g.group_size),
        )
    return train, val


def check_prompts(cfg: Config, train_rec, val_rec) -> str:
    """GRPO's records: a prompt column in every split (pairs or completions are not prompts)."""
    d = cfg.data
    for name, rec in (("training", train_rec), ("validation", val_rec)):
        if rec is None:
            continue
        columns = [c for c in rec.column_names if c != records_io.ORIGIN]
        if d.prompt_field not in columns:
            raise DataError(
                f"training.objective=grpo needs a '{d.prompt_field}' column (text or chat "
                f"messages); the {name} records of {d.path} have {columns}.",
                hint="rename the column holding the prompts, or set data.prompt_field",
            )
    return "prompt"


def check_objective(cfg: Config, fmt: str, columns: list[str]) -> None:
    """Preference pairs go with a preference objective, and only with one; labelled completions
    with KTO, which also takes pairs."""
    d, objective = cfg.data, cfg.training.objective
    if objective == "kto":
        if fmt not in ("unpaired", "preference"):
            columns = [c for c in columns if c != records_io.ORIGIN]
            raise DataError(
                f"training.objective=kto needs labelled completions (columns '{d.prompt_field}', "
                f"'{d.completion_field}' and '{d.label_field}', or '{d.messages_field}' and "
                f"'{d.label_field}') or preference pairs; {d.path} has {columns}.",
                hint="rename the columns (or set data.completion_field / data.label_field)",
            )
        return

    if objective == "sft" and fmt == "preference":
        raise DataError(
            f"{d.path}: preference pairs (columns '{d.chosen_field}' and '{d.rejected_field}'), "
            "but training.objective=sft.",
            hint="set --training.objective dpo (or orpo / simpo) to train on pairs",
        )
    if objective != "sft" and fmt != "preference":
        columns = [c for c in columns if c != records_io.ORIGIN]  # ours, not the user's
        raise DataError(
            f"training.objective={objective} needs preference pairs: columns '{d.prompt_field}', "
            f"'{d.chosen_field}' and '{d.rejected_field}'; {d.path} has {columns}.",
            hint="rename the columns (or set data.chosen_field / data.rejected_field), or train "
            "with training.objective=sft",
        )


def check_positions(cfg: Config, model_name: str) -> None:
    """data.seq_len against the model's max_position_embeddings, read from its config alone (no
    weights). A config that cannot be read here is left to the model load, which explains why."""
    try:
        config = models.model_config(model_name, cfg.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - any failure here is reported by the model load (assemble) with its fix
        return
    check_seq_len(cfg, getattr(config, "max_position_embeddings", None))


def longest_sequence(cfg: Config) -> int:
    """The longest row the run trains on: data.seq_len, plus the completion for GRPO (whose
    data.seq_len bounds the prompt)."""
    if cfg.training.objective == "grpo":  # with tools, a conversation (completion_tokens)
        return cfg.data.seq_len + cfg.grpo.completion_tokens()
    return cfg.data.seq_len


def check_seq_len(cfg: Config, limit) -> None:
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={limit}.",
            hint=f"set data.seq_len <= {limit}",
        )
    longest = longest_sequence(cfg)
    if cfg.training.objective == "grpo" and isinstance(limit, int) and longest > limit:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} (the longest prompt) + grpo.max_completion_length="
            f"{cfg.grpo.max_completion_length}"
            f"{' x (2 grpo.max_turns - 1) turns and tool results' if cfg.grpo.tools else ''} = "
            f"{longest} exceeds the model's max_position_embeddings={limit}.",
            hint=f"lower grpo.max_completion_length or data.seq_len so they add up to <= {limit}",
        )
