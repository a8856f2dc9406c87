"""TRL's preference trainers as peers of `onegpu bench train --objective dpo|kto|reward`, in the
arm's own process (see train_child.py): ``DPOTrainer``, ``KTOTrainer`` and ``RewardTrainer`` at
their defaults; and the clock on our precomputed reference pass.

TRL gets the very records our loop trains on (the pairs ``pairs.corpus_pairs`` makes from the
standard library, or data.path's; for KTO each pair's two sides a desirable and an undesirable
example; for a reward model with the margin column when the data has one), in the order our loop
draws them, and tokenizes them itself. The bench then checks that its token ids equal ours record
by record, so both count the same real tokens: a pair's prompt, chosen and rejected ids; a KTO
example's prompt + completion (the mismatched sequences of its KL estimate are extra work on both
sides, not counted); a reward model's chosen and rejected sequences (prompt + response). Only what
a fair comparison needs is set to our run's values (train_peers.hf_arguments plus
``aligned_arguments``, each with its reason); the rest, the reference included, is TRL's own
default (for reward models also gradient checkpointing, padding to the longest sequence and its
metrics every step).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from onegpu.bench import train_peers

# Our record columns' TRL names (the data config's field for each), paired and unpaired.
PAIR_FIELDS = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}
UNPAIRED_FIELDS = {
    "prompt_field": "prompt",
    "completion_field": "completion",
    "label_field": "label",
}
PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")


# ---------------------------------------------------------------------------------------- onegpu
def reference_pass(run, seconds: float | None) -> dict:
    """Our precomputed reference (objectives/reference.py: one no-grad pass over every pair before
    the first step) as the run timed it, with its pairs and tokens: it runs before the loop's timing
    windows, so the report charges it separately instead of it vanishing from tokens/s.

    That pass is the process's first forward and pays its one-off start-up (kernel and allocator
    warm-up), which the other arms pay in their untimed first steps. The same pass again, warm
    (results discarded, no weights touched), is what the report charges to tokens/s. Called when the
    loop begins (Callback.on_train_begin): the first logged window, untimed, holds it. ``seconds``:
    the run's own pass, as the run reported it (Callback.on_reference_pass); None when it made none
    (no precomputed reference, or a resumed run).
    """
    import torch

    from onegpu.objectives import reference

    if run is None or seconds is None:
        return {}
    splits = [ds for ds in (run.train_ds, run.val_ds) if ds is not None]
    t0 = time.perf_counter()
    for ds in splits:
        reference.compute(
            run.model,
            ds,
            run.objective.tokens,
            run.collator,
            run.cfg.training.micro_batch_size,
            torch.device(run.device.type),
        )
    return {
        "seconds": seconds,
        "pairs": sum(len(ds) for ds in splits),
        "tokens": sum(sum(train_peers.example_tokens(ds)) for ds in splits),
        "warm_seconds": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------ TRL
def _encoded(records, tok, data_cfg, unpaired: bool) -> list:
    """Our token ids of each record as one hashable key (None: a KTO example our data code cut)."""
    from onegpu.data import overlong
    from onegpu.data import unpaired as unpaired_data
    from onegpu.data.pairs import encode_pair

    if unpaired:
        cols = {c: records[c] for c in records.column_names}
        ours = unpaired_data.tokenize_batch(cols, list(range(len(records))), tok, data_cfg, "train")
        return [
            (tuple(p), tuple(c)) if fate == overlong.FIT else None
            for p, c, fate in zip(
                ours["prompt_ids"], ours["completion_ids"], ours[overlong.FATE], strict=True
            )
        ]
    f = data_cfg
    pairs = (
        encode_pair(
            r.get(f.prompt_field), r[f.chosen_field], r[f.rejected_field], tok, f, f"record {i}"
        )
        for i, r in enumerate(records)
    )
    return [tuple(map(tuple, ids)) for ids in pairs]


def record_rows(records, tokenized, tok, data_cfg, unpaired: bool = False) -> list[int]:
    """For each tokenized pair (KTO: example) of run.train_ds, after over-long ones were left out,
    the record it came from. One our data code truncated has no record with its tokens; TRL would
    cut it elsewhere (the end, not the prompt's start), so the bench refuses rather than compare
    different tokens."""
    from onegpu.errors import ConfigError

    keys = ("prompt_ids", "completion_ids") if unpaired else PAIR_KEYS
    index: dict = {}
    for i, key in enumerate(_encoded(records, tok, data_cfg, unpaired)):
        if key is not None:
            index.setdefault(key, i)
    rows = []
    for j, ex in enumerate(tokenized):
        i = index.get(tuple(tuple(ex[k]) for k in keys))
        if i is None:
            raise ConfigError(
                f"training {'example' if unpaired else 'pair'} {j} was truncated to "
                f"data.seq_len={data_cfg.seq_len}: TRL would truncate it differently, so the two "
                "would not train on the same tokens.",
                hint="raise --data.seq_len, or set --data.overlong drop",
            )
        rows.append(i)
    return rows


def trl_records(records, rows: list[int], data_cfg, unpaired: bool = False):
    """The records in the given order, with TRL's column names (prompt / chosen / rejected, or
    prompt / completion / label)."""
    fields = UNPAIRED_FIELDS if unpaired else PAIR_FIELDS
    cols = {getattr(data_cfg, field): name for field, name in fields.items()}
    ds = records.select(rows).select_columns([c for c in cols if c in records.column_names])
    return ds.rename_columns({k: v for k, v in cols.items() if k != v and k in ds.column_names})


def with_margin(trl_ds, records, rows: list[int], data_cfg):
    """TRL's records with the pairs' margin column (RewardTrainer reads it as ``margin``)."""
    if data_cfg.margin_field not in records.column_names:
        return trl_ds
    return trl_ds.add_column("margin", [float(records[data_cfg.margin_field][i]) for i in rows])


def aligned_arguments(cfg, device, objective: str) -> dict:
    """DPOConfig / KTOConfig / RewardConfig settings set to our run's, each because the comparison
    needs it (hf_arguments already aligns batch, accumulation, steps, learning rate and schedule,
    optimizer betas, clipping, seed)."""
    from onegpu.objectives.preference import resolve_beta

    p = cfg.preference
    # TRL cuts at (reward models: leaves out pairs over) 1024 tokens by default; ours at
    # data.seq_len (no record here reaches either: see record_rows)
    kw = {**train_peers.precision_arguments(cfg, device), "max_length": cfg.data.seq_len}
    # the loss itself; TRL's defaults are ours too (DPO's beta 0.1 and label smoothing 0.0, KTO's
    # beta 0.1 and weights 1.0, a reward model's centring None)
    if objective == "reward":
        kw["center_rewards_coefficient"] = p.center_rewards_coefficient
    else:
        kw["beta"] = resolve_beta(objective, p.beta)
    if objective == "dpo":
        kw["label_smoothing"] = p.label_smoothing
    if objective == "kto":
        kw.update(desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
    return kw


def lora_config(cfg, task_type: str = "CAUSAL_LM"):
    """The LoRA arm's adapters, as techniques/lora.py builds ours: the same trainable weights
    (``task_type`` SEQ_CLS: a reward model's, whose score head PEFT then trains whole, as ours)."""
    import peft

    lcfg = cfg.techniques.lora
    return peft.LoraConfig(
        r=lcfg.r,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=lcfg.targets
        if lcfg.targets == "all-linear"
        else [t.strip() for t in lcfg.targets.split(",") if t.strip()],
        use_dora=lcfg.dora,
        bias="none",
        task_type=task_type,
    )


def default_reference(model, lora: bool):
    """What TRL does with ref_model=None, made possible here: with PEFT, nothing (it disables the
    adapters); for a full fine-tune it loads a second copy of the policy from the policy's path,
    which a model built in memory from a preset does not have, so the bench hands it that copy
    itself."""
    path = getattr(model.config, "_name_or_path", "") or ""
    if lora or (Path(path) / "config.json").is_file():
        return None
    return copy.deepcopy(model)


def run_trl_preference(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's DPOTrainer, KTOTrainer or RewardTrainer (the run's training.objective) at its defaults
    on our records in our order: full, or LoRA with the same adapters (a reward model's score head
    trained whole)."""
    import trl

    p = train_peers.setup(spec)
    cfg = p.cfg
    objective = cfg.training.objective
    config_cls, trainer_cls = {
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "kto": (trl.KTOConfig, trl.KTOTrainer),
        "reward": (trl.RewardConfig, trl.RewardTrainer),
    }[objective]
    unpaired, reward = objective == "kto", objective == "reward"
    rows = record_rows(p.records.train, p.data.train_ds, p.data.tokenizer, cfg.data, unpaired)
    order = [rows[i] for i in p.indices]
    records = trl_records(p.records.train, order, cfg.data, unpaired)
    if reward:
        records = with_margin(records, p.records.train, order, cfg.data)
    clock = train_peers.timer(spec, p)
    args = config_cls(
        **{
            **train_peers.hf_arguments(cfg, spec["arm"], p.device),
            **aligned_arguments(cfg, p.device, objective),
        }
    )
    lora = cfg.techniques.lora.enabled
    ref = {} if reward else {"ref_model": default_reference(p.model, lora)}
    trainer = trainer_cls(
        model=p.model,
        args=args,
        train_dataset=records,
        processing_class=p.data.tokenizer,
        peft_config=lora_config(cfg, "SEQ_CLS" if reward else "CAUSAL_LM") if lora else None,
        callbacks=[clock, *callbacks],
        **ref,
    )
    same = same_tokens(trainer.train_dataset, p.dataset, objective)
    trainer.train()
    out = train_peers._result(trainer, args, clock, p.per_step)
    model = trainer.model
    evidence = dict(
        trl=trl.__version__,
        max_length=args.max_length,
        peft=hasattr(model, "disable_adapter"),
        same_tokens=same,
    )
    if reward:
        evidence.update(
            center_rewards_coefficient=args.center_rewards_coefficient,
            score_head=type(model.get_base_model() if lora else model).__name__,
        )
    else:
        evidence.update(
            loss_type=list(args.loss_type) if objective == "dpo" else args.loss_type,
            beta=args.beta,
            reference="adapters off (PEFT model, ref_model None)"
            if lora
            else "frozen copy, "
            + (
                "loaded by TRL from the policy's path"
                if ref["ref_model"] is None
                else "handed over as ref_model (no path to load from)"
            ),
            precompute_ref_log_probs=bool(args.precompute_ref_log_probs),
        )
    if objective == "dpo":
        evidence["pad_to_multiple_of"] = args.pad_to_multiple_of
    out["evidence"].update(evidence)
    history = trainer.state.log_history
    key = {"dpo": "rewards/accuracies", "kto": "kl", "reward": "accuracy"}[objective]
    last = next((h for h in reversed(history) if key in h), {})
    if unpaired:
        out["kl"] = last.get("kl")
    else:
        out["reward_accuracy"] = last.get(key)
        out["reward_margin"] = last.get("rewards/margins" if objective == "dpo" else "margin")
    return out


def same_tokens(trl_dataset, ours, objective: str) -> bool:
    """TRL's own tokenization of the records against ours, record by record (same order): a
    difference would make the token counts, and so tokens/s, incomparable. TRL tokenizes a reward
    model's sequences as one text (prompt + response), ours each apart (DPO's rules)."""
    what = "example" if objective == "kto" else "pair"
    if len(trl_dataset) != len(ours):
        raise RuntimeError(f"TRL kept {len(trl_dataset)} {what}s of {len(ours)}")
    keys = ("prompt_ids", "completion_ids") if objective == "kto" else PAIR_KEYS
    for j in range(len(ours)):
        a, b = trl_dataset[j], ours[j]
        if objective == "reward":
            differs = any(
                list(a[f"{s}_ids"]) != list(b["prompt_ids"]) + list(b[f"{s}_ids"])
                for s in ("chosen", "rejected")
            )
        else:
            differs = any(list(a[k]) != list(b[k]) for k in keys)
        if differs:
            raise RuntimeError(
                f"TRL tokenized {what} {j} differently from onegpu: the arms would not be "
                "comparable"
            )
    return True
