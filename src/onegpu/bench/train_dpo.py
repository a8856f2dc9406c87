"""DPO arms of `onegpu bench train --objective dpo`, in the arm's own process (see train_child.py):
TRL's ``DPOTrainer`` at its defaults as the peer, and the clock on our reference pass.

TRL gets the very records our loop trains on (the pairs ``pairs.corpus_pairs`` makes from the
standard library, or data.path's), in the order our loop draws them, and tokenizes them itself; the
bench then checks that its token ids equal ours pair by pair, so both count the same real tokens.
Only what a fair comparison needs is set to our run's values (hf_arguments plus
``aligned_arguments`` below, each with its reason); the rest, the reference included, is TRL's own
default.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from onegpu.bench import train_peers


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
def record_rows(records, tokenized, tok, data_cfg) -> list[int]:
    """For each tokenized pair (run.train_ds, after over-long pairs were left out), the record it
    came from. A pair our data code truncated has no record with its tokens; TRL would cut it
    elsewhere (the end, not the prompt's start), so the bench refuses rather than compare different
    tokens."""
    from onegpu.data.pairs import encode_pair
    from onegpu.errors import ConfigError

    index: dict = {}
    for i, r in enumerate(records):
        ids = encode_pair(
            r.get(data_cfg.prompt_field),
            r[data_cfg.chosen_field],
            r[data_cfg.rejected_field],
            tok,
            data_cfg,
            f"record {i}",
        )
        index.setdefault(tuple(map(tuple, ids)), i)
    rows = []
    for j, ex in enumerate(tokenized):
        i = index.get((tuple(ex["prompt_ids"]), tuple(ex["chosen_ids"]), tuple(ex["rejected_ids"])))
        if i is None:
            raise ConfigError(
                f"training pair {j} was truncated to data.seq_len={data_cfg.seq_len}: TRL would "
                "truncate it differently, so the two would not train on the same tokens.",
                hint="raise --data.seq_len, or set --data.overlong drop",
            )
        rows.append(i)
    return rows


def trl_records(records, rows: list[int], data_cfg):
    """The records in the given order, with TRL's column names (prompt / chosen / rejected)."""
    cols = {
        data_cfg.prompt_field: "prompt",
        data_cfg.chosen_field: "chosen",
        data_cfg.rejected_field: "rejected",
    }
    ds = records.select(rows).select_columns([c for c in cols if c in records.column_names])
    return ds.rename_columns({k: v for k, v in cols.items() if k != v and k in ds.column_names})


def aligned_arguments(cfg, device) -> dict:
    """DPOConfig settings set to our run's, each because the comparison needs it (hf_arguments
    already aligns batch, accumulation, steps, learning rate and schedule, optimizer betas,
    clipping, seed)."""
    from onegpu.objectives.preference import resolve_beta

    kw = dict(
        **precision_arguments(cfg, device),
        # TRL cuts at 1024 tokens by default; ours at data.seq_len (no pair here reaches either: see
        # record_rows)
        max_length=cfg.data.seq_len,
        # the same objective: beta and label smoothing are the loss itself (TRL's 0.1 and 0.0 are
        # our defaults too)
        beta=resolve_beta("dpo", cfg.preference.beta),
        label_smoothing=cfg.preference.label_smoothing,
    )
    return kw


def precision_arguments(cfg, device) -> dict:
    """The same arithmetic on TRL's side: its default is bf16 autocast, ours fp32 on a CPU and the
    preset's bf16 on a GPU (every TRL peer: DPO, KTO, reward models)."""
    from onegpu.techniques.precision import resolve_precision

    precision = resolve_precision(cfg.techniques, device)
    kw = {"bf16": precision.startswith("bf16"), "fp16": precision == "fp16"}
    if device.type == "cpu":
        kw["use_cpu"] = True
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


def run_trl_dpo(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's DPOTrainer at its defaults on our records in our order (full, or LoRA with the same
    adapters)."""
    import trl
    from trl import DPOConfig, DPOTrainer

    p = train_peers.setup(spec)
    cfg = p.cfg
    rows = record_rows(p.records.train, p.data.train_ds, p.data.tokenizer, cfg.data)
    records = trl_records(p.records.train, [rows[i] for i in p.indices], cfg.data)
    timer = train_peers.make_timer(
        spec["warmup_steps"], spec["budget_s"], cfg.training.log_every, p.device.type == "cuda"
    )
    args = DPOConfig(
        **{
            **train_peers.hf_arguments(cfg, spec["arm"], p.device),
            **aligned_arguments(cfg, p.device),
        }
    )
    lora = cfg.techniques.lora.enabled
    ref_model = default_reference(p.model, lora)
    trainer = DPOTrainer(
        model=p.model,
        ref_model=ref_model,
        args=args,
        train_dataset=records,
        processing_class=p.data.tokenizer,
        peft_config=lora_config(cfg) if lora else None,
        callbacks=[timer, *callbacks],
    )
    same = same_tokens(trainer.train_dataset, p.dataset)
    trainer.train()
    out = train_peers._result(trainer, args, timer, p.per_step)
    last = next((h for h in reversed(trainer.state.log_history) if "rewards/accuracies" in h), {})
    total = sum(x.numel() for x in trainer.model.parameters())
    out["evidence"].update(
        trl=trl.__version__,
        loss_type=list(args.loss_type),
        beta=args.beta,
        max_length=args.max_length,
        reference=(
            "adapters off (PEFT model, ref_model None)"
            if lora
            else "frozen copy, "
            + (
                "loaded by TRL from the policy's path"
                if ref_model is None
                else "handed over as ref_model (no path to load from)"
            )
        ),
        precompute_ref_log_probs=bool(args.precompute_ref_log_probs),
        peft=hasattr(trainer.model, "disable_adapter"),
        trainable_params=sum(x.numel() for x in trainer.model.parameters() if x.requires_grad),
        total_params=total,
        same_tokens=same,
        pad_to_multiple_of=args.pad_to_multiple_of,
    )
    out["reward_accuracy"] = last.get("rewards/accuracies")
    out["reward_margin"] = last.get("rewards/margins")
    return out


def same_tokens(trl_dataset, ours) -> bool:
    """TRL's own tokenization of the records against ours, pair by pair (same order): a difference
    would make the token counts, and so tokens/s, incomparable."""
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    if len(trl_dataset) != len(ours):
        raise RuntimeError(f"TRL kept {len(trl_dataset)} pairs of {len(ours)}")
    for j in range(len(ours)):
        a, b = trl_dataset[j], ours[j]
        if any(list(a[k]) != list(b[k]) for k in keys):
            raise RuntimeError(
                f"TRL tokenized pair {j} differently from onegpu: the arms would not be comparable"
            )
    return True
