"""What a run optimises, behind one protocol (objectives/base.Objective): SFT (sft.py), the
preference objectives DPO / ORPO / SimPO (preference.py), KTO (kto.py), their reference
(reference.py), reward models (reward.py) and GRPO
(grpo.py: rollouts, rewards.py, grpo_loss.py). The
output head's loss they share, fused or plain, is a method applied to the model
(techniques/fused_loss.py) reached through tokens.TokenLoss."""

from __future__ import annotations

from onegpu.objectives.base import Objective

__all__ = ["Objective", "make_objective"]


def make_objective(
    cfg,
    vocab: int,
    on_gpu: bool,
    reference_model=None,
    autocast=None,
    probe: bool = False,
    tokenizer=None,
    compiled: bool = False,
) -> Objective:
    """The run's objective from training.objective and the loss settings, with the reference DPO
    needs built in (reference.choose says which): ``reference_model`` is the frozen copy
    (preference.reference=copy) already on its device, ``autocast`` the run's; ``probe``: a planner
    probe of a precomputed reference, which times the step with fixed reference log-probs;
    ``tokenizer``: GRPO's, which decodes completions for the rewards; ``compiled``: the run compiles
    (GRPO compiles its rollouts' decode step too)."""
    from onegpu import distributed
    from onegpu.objectives.tokens import TokenLoss

    tokens = TokenLoss.for_run(cfg.techniques, vocab, on_gpu, distributed.shards_weights(cfg))
    if cfg.training.objective == "sft":
        from onegpu.objectives.sft import SFT

        return SFT(tokens)
    if cfg.training.objective == "reward":
        from onegpu.objectives.reward import Reward

        trim = not on_gpu and not compiled
        return Reward(cfg.preference, tokens, trim=trim, shared=cfg.techniques.shared_prompt)
    from onegpu.objectives import reference

    if cfg.training.objective == "grpo":
        from onegpu.objectives import rewards
        from onegpu.objectives.grpo import GRPO

        ref = reference.build(reference.kind_of(cfg), tokens, reference_model, autocast, probe)
        tools = None
        if cfg.grpo.tools:  # multi-turn rollouts that call tools (multiturn.py)
            from onegpu.objectives.multiturn import ToolUse

            tools = ToolUse.for_run(cfg.grpo, tokenizer)
        return GRPO(
            cfg.grpo,
            tokens,
            rewards.resolve(cfg.grpo, default_job=cfg.data.path is None),
            tokenizer,
            cfg.data.prompt_field,
            ref,
            cfg.data.pad_to_multiple,
            compiled,
            max_prompt=cfg.data.seq_len,
            tools=tools,
        )
    kind = reference.choose(
        cfg.training.objective, cfg.preference.reference, cfg.techniques.lora.enabled
    )
    ref = reference.build(kind, tokens, reference_model, autocast, probe)
    if cfg.training.objective == "kto":
        from onegpu.objectives.kto import KTO

        return KTO(cfg.preference, tokens, ref)
    from onegpu.objectives.preference import Preference

    return Preference(cfg.training.objective, cfg.preference, tokens, ref)
