"""Reward-model arms of `onegpu bench train --objective reward`, in the arm's own process (see
train_child.py): TRL's ``RewardTrainer`` at its defaults as the peer.

TRL gets the very pairs our loop trains on (``pairs.corpus_pairs``' from the standard library, or
data.path's, with the margin column when the data has one), in the order our loop draws them, and
tokenizes them itself; the bench checks that each of its chosen and rejected sequences equals ours
(prompt + response), so both count the same real tokens. Only what a fair comparison needs is set
to our run's values; the rest is TRL's own default (gradient checkpointing, padding to the longest
sequence, its metrics every step).
"""

from __future__ import annotations

from onegpu.bench import train_peers
from onegpu.bench.train_dpo import lora_config, precision_arguments, record_rows, trl_records


def aligned_arguments(cfg, device) -> dict:
    """RewardConfig settings set to our run's, each because the comparison needs it (hf_arguments
    already aligns batch, accumulation, steps, learning rate and schedule, optimizer betas,
    clipping, seed)."""
    return {
        **precision_arguments(cfg, device),
        # TRL leaves out pairs over 1024 tokens by default; ours are cut at data.seq_len (no pair
        # here reaches either: see train_dpo.record_rows)
        "max_length": cfg.data.seq_len,
        # the loss itself (TRL's default None is ours too)
        "center_rewards_coefficient": cfg.preference.center_rewards_coefficient,
    }


def with_margin(trl_ds, records, rows: list[int], data_cfg):
    """TRL's records with the pairs' margin column (RewardTrainer reads it as ``margin``)."""
    if data_cfg.margin_field not in records.column_names:
        return trl_ds
    return trl_ds.add_column("margin", [float(records[data_cfg.margin_field][i]) for i in rows])


def run_trl_reward(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's RewardTrainer at its defaults on our pairs in our order (full, or LoRA with the same
    adapters and the score head trained whole)."""
    import trl
    from trl import RewardConfig, RewardTrainer

    p = train_peers.setup(spec)
    cfg = p.cfg
    rows = record_rows(p.records.train, p.data.train_ds, p.data.tokenizer, cfg.data)
    order = [rows[i] for i in p.indices]
    records = trl_records(p.records.train, order, cfg.data)
    records = with_margin(records, p.records.train, order, cfg.data)
    timer = train_peers.make_timer(
        spec["warmup_steps"], spec["budget_s"], cfg.training.log_every, p.device.type == "cuda"
    )
    args = RewardConfig(
        **{
            **train_peers.hf_arguments(cfg, spec["arm"], p.device),
            **aligned_arguments(cfg, p.device),
        }
    )
    lora = cfg.techniques.lora.enabled
    trainer = RewardTrainer(
        model=p.model,
        args=args,
        train_dataset=records,
        processing_class=p.data.tokenizer,
        peft_config=lora_config(cfg, "SEQ_CLS") if lora else None,
        callbacks=[timer, *callbacks],
    )
    same = same_tokens(trainer.train_dataset, p.dataset)
    trainer.train()
    out = train_peers._result(trainer, args, timer, p.per_step)
    last = next((h for h in reversed(trainer.state.log_history) if "accuracy" in h), {})
    out["evidence"].update(
        trl=trl.__version__,
        max_length=args.max_length,
        center_rewards_coefficient=args.center_rewards_coefficient,
        peft=hasattr(trainer.model, "disable_adapter"),
        score_head=type(trainer.model.get_base_model() if lora else trainer.model).__name__,
        trainable_params=sum(x.numel() for x in trainer.model.parameters() if x.requires_grad),
        total_params=sum(x.numel() for x in trainer.model.parameters()),
        same_tokens=same,
    )
    out["reward_accuracy"] = last.get("accuracy")
    out["reward_margin"] = last.get("margin")
    return out


def same_tokens(trl_dataset, ours) -> bool:
    """TRL's tokenization (prompt and response as one text) against ours (each apart, DPO's rules),
    pair by pair in the same order: a difference would make the token counts incomparable."""
    if len(trl_dataset) != len(ours):
        raise RuntimeError(f"TRL kept {len(trl_dataset)} pairs of {len(ours)}")
    for j in range(len(ours)):
        a, b = trl_dataset[j], ours[j]
        for side in ("chosen", "rejected"):
            if list(a[f"{side}_ids"]) != list(b["prompt_ids"]) + list(b[f"{side}_ids"]):
                raise RuntimeError(
                    f"TRL tokenized pair {j}'s {side} sequence differently from onegpu: the arms "
                    "would not be comparable"
                )
    return True
