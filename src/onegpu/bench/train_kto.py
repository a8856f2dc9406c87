"""KTO arms of `onegpu bench train --objective kto`, in the arm's own process (see train_child.py):
TRL's ``KTOTrainer`` at its defaults as the peer.

TRL gets the very records our loop trains on (the pairs ``pairs.corpus_pairs`` makes from the
standard library, each pair's two sides a desirable and an undesirable example, or data.path's), in
the order our loop draws them, and tokenizes them itself; the bench checks that its prompt and
completion ids equal ours example by example, so both count the same real tokens (each example's
prompt + completion; the mismatched sequences of the KL estimate are extra work on both sides,
not counted). Only what a fair comparison needs is set to our run's values (hf_arguments plus
``aligned_arguments``); the rest, the reference included, is TRL's own default.
"""

from __future__ import annotations

from onegpu.bench import train_peers
from onegpu.bench.train_dpo import default_reference, lora_config, precision_arguments


def record_rows(records, tokenized, tok, data_cfg) -> list[int]:
    """For each tokenized example (run.train_ds, after over-long ones were left out), the record it
    came from; one our data code truncated is refused (TRL would cut it elsewhere)."""
    from onegpu.data import overlong, unpaired
    from onegpu.errors import ConfigError

    cols = {c: records[c] for c in records.column_names}
    ours = unpaired.tokenize_batch(cols, list(range(len(records))), tok, data_cfg, "train")
    index: dict = {}
    for i, (p, c) in enumerate(zip(ours["prompt_ids"], ours["completion_ids"], strict=True)):
        index.setdefault((tuple(p), tuple(c)), i)
    rows = []
    for j, ex in enumerate(tokenized):
        i = index.get((tuple(ex["prompt_ids"]), tuple(ex["completion_ids"])))
        if i is None or ours[overlong.FATE][i] != overlong.FIT:
            raise ConfigError(
                f"training example {j} was truncated to data.seq_len={data_cfg.seq_len}: TRL would "
                "truncate it differently, so the two would not train on the same tokens.",
                hint="raise --data.seq_len, or set --data.overlong drop",
            )
        rows.append(i)
    return rows


def trl_records(records, rows: list[int], data_cfg):
    """The records in the given order, with TRL's column names (prompt / completion / label)."""
    cols = {
        data_cfg.prompt_field: "prompt",
        data_cfg.completion_field: "completion",
        data_cfg.label_field: "label",
    }
    ds = records.select(rows).select_columns([c for c in cols if c in records.column_names])
    return ds.rename_columns({k: v for k, v in cols.items() if k != v and k in ds.column_names})


def aligned_arguments(cfg, device) -> dict:
    """KTOConfig settings set to our run's, each because the comparison needs it (hf_arguments
    already aligns batch, accumulation, steps, learning rate and schedule, optimizer betas,
    clipping, seed)."""
    from onegpu.objectives.preference import resolve_beta

    p = cfg.preference
    return {
        **precision_arguments(cfg, device),
        # TRL cuts at 1024 tokens by default; ours at data.seq_len (no example here reaches either:
        # see record_rows)
        "max_length": cfg.data.seq_len,
        # the loss itself (TRL's defaults 0.1, 1.0 and 1.0 are ours too)
        "beta": resolve_beta("kto", p.beta),
        "desirable_weight": p.desirable_weight,
        "undesirable_weight": p.undesirable_weight,
    }


def run_trl_kto(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's KTOTrainer at its defaults on our records in our order (full, or LoRA with the same
    adapters)."""
    import trl
    from trl import KTOConfig, KTOTrainer

    p = train_peers.setup(spec)
    cfg = p.cfg
    rows = record_rows(p.records.train, p.data.train_ds, p.data.tokenizer, cfg.data)
    records = trl_records(p.records.train, [rows[i] for i in p.indices], cfg.data)
    timer = train_peers.make_timer(
        spec["warmup_steps"], spec["budget_s"], cfg.training.log_every, p.device.type == "cuda"
    )
    args = KTOConfig(
        **{
            **train_peers.hf_arguments(cfg, spec["arm"], p.device),
            **aligned_arguments(cfg, p.device),
        }
    )
    lora = cfg.techniques.lora.enabled
    ref_model = default_reference(p.model, lora)
    trainer = KTOTrainer(
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
    total = sum(x.numel() for x in trainer.model.parameters())
    out["evidence"].update(
        trl=trl.__version__,
        loss_type=args.loss_type,
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
    )
    last = next((h for h in reversed(trainer.state.log_history) if "kl" in h), {})
    out["kl"] = last.get("kl")
    return out


def same_tokens(trl_dataset, ours) -> bool:
    """TRL's own tokenization of the records against ours, example by example (same order): a
    difference would make the token counts, and so tokens/s, incomparable."""
    if len(trl_dataset) != len(ours):
        raise RuntimeError(f"TRL kept {len(trl_dataset)} examples of {len(ours)}")
    for j in range(len(ours)):
        a, b = trl_dataset[j], ours[j]
        if any(list(a[k]) != list(b[k]) for k in ("prompt_ids", "completion_ids")):
            raise RuntimeError(
                f"TRL tokenized example {j} differently from onegpu: the arms would not be "
                "comparable"
            )
    return True
