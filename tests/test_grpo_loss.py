"""GRPO's advantages and what they imply: normalised within each group as TRL's GRPOTrainer
normalises them (its formula, its 1e-4), by the batch or not at all; unscored completions get 0; a
group whose rewards are all equal contributes no gradient; and the reference of a LoRA run, the
policy with its adapters off, is the base model."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import GRPOConfig
from onegpu.objectives import grpo_loss, rollout
from onegpu.objectives.grpo import ADV, GRPO
from onegpu.objectives.tokens import TokenLoss, with_target_positions

GROUP = 4
REWARDS = [0.0, 1.0, 0.5, 0.25, 3.0, -1.0, 2.0, 2.5, 0.1, 0.1, 0.9, 0.0]  # 3 groups of 4
TEMPERATURE = 0.8


def _trl_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """TRL 1.16's _generate_and_score_completions (multi_objective_aggregation=sum_then_normalize),
    on the summed rewards, written with its own nanstd."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return adv


# ----------------------------------------------------------------------------------- advantages
def test_group_advantages_have_mean_0_and_std_1_in_every_group():
    adv = grpo_loss.advantages(torch.tensor(REWARDS), GROUP, "group").view(-1, GROUP)
    assert torch.allclose(adv.mean(1), torch.zeros(3), atol=1e-6)
    std = torch.tensor(REWARDS).view(-1, GROUP).std(1)
    # std 1 up to TRL's 1e-4 in the denominator: exactly std / (std + 1e-4)
    torch.testing.assert_close(adv.std(1), std / (std + 1e-4))
    assert torch.allclose(adv.std(1), torch.ones(3), atol=1e-3)
    # each group by itself: the others do not change it
    alone = grpo_loss.advantages(torch.tensor(REWARDS[4:8]), GROUP, "group")
    torch.testing.assert_close(adv[1], alone)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_formula(scale):
    trl = pytest.importorskip("trl")  # noqa: F841 (its nanstd is the reference)
    rewards = torch.tensor(REWARDS)
    ours = grpo_loss.advantages(rewards, GROUP, scale)
    torch.testing.assert_close(ours, _trl_advantages(rewards, GROUP, scale), rtol=0, atol=1e-6)
    # the three scales differ on these rewards (the test would see a wrong branch)
    others = [grpo_loss.advantages(rewards, GROUP, s) for s in ("group", "batch", "none")]
    assert sum(not torch.allclose(ours, o) for o in others) == 2


def test_batch_scale_divides_by_the_std_of_the_whole_batch():
    rewards = torch.tensor(REWARDS)
    adv = grpo_loss.advantages(rewards, GROUP, "batch")
    centred = grpo_loss.advantages(rewards, GROUP, "none")
    torch.testing.assert_close(
        centred, rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP)
    )
    torch.testing.assert_close(adv, centred / (rewards.std() + 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_get_advantage_0_and_leave_their_group_out(scale):
    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 0.0, 1.0, nan, nan, nan, nan, 2.0, 0.0, 1.0, 0.5])
    adv = grpo_loss.advantages(rewards, GROUP, scale)
    assert not torch.isnan(adv).any()
    assert adv[1] == 0 and (adv[4:8] == 0).all()  # unscored; a group with no score at all
    scored = torch.tensor([1.0, 0.0, 1.0])  # the first group's scored completions, alone
    expected = scored - scored.mean()
    if scale == "group":
        expected = expected / (scored.std() + 1e-4)
        torch.testing.assert_close(adv[[0, 2, 3]], expected)
        torch.testing.assert_close(adv[8:], grpo_loss.advantages(rewards[8:], GROUP, "group"))
    elif scale == "none":
        torch.testing.assert_close(adv[[0, 2, 3]], expected)
    torch.testing.assert_close(
        adv[~torch.isnan(rewards)], _trl_advantages(rewards, GROUP, scale)[~torch.isnan(rewards)]
    )


# ------------------------------------------------------------------- a group of equal rewards
def _model_and_rows(tok, n: int, seed: int = 0):
    """The tiny model and n (prompt ids, completion ids) rows of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, len(tok), (3 + i % 3,), generator=gen).tolist() for i in range(n)]
    completions = [
        torch.randint(3, len(tok), (4 + (5 * i) % 7,), generator=gen).tolist() for i in range(n)
    ]
    return make_tiny_llama(tok), prompts, completions


def _batch(tok, prompts, completions, adv):
    samples = rollout.Samples(completions, [False] * len(completions), 0.0)
    batch = rollout.training_rows(prompts, samples, tok.pad_token_id, False)
    batch[ADV] = adv
    return with_target_positions(batch)


def _objective(tok, loss_type="dapo", chunk=0):
    g = GRPOConfig(
        group_size=GROUP, max_completion_length=16, temperature=TEMPERATURE, loss_type=loss_type
    )
    return GRPO(g, TokenLoss(chunk), [], tok, "prompt")


def _grads(model, objective, batch, normalise: bool):
    model.zero_grad(set_to_none=True)
    loss = objective.loss(model, batch)
    if normalise:
        loss = loss / objective.count(batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


FLAT = [
    pytest.param(1.0, id="reward-1.0"),
    # 8 x 0.7 in fp32: the mean is off by 6e-8, the std is 6e-8, and the advantages become
    # 6e-8 / (6e-8 + 1e-4) = 6e-4, all of one sign: the group pushes its completions one way
    pytest.param(0.7, id="reward-0.7"),
]


@pytest.mark.parametrize("value", FLAT)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_has_advantage_0(value, scale):
    adv = grpo_loss.advantages(torch.full((8,), value), 8, scale)
    assert torch.count_nonzero(adv) == 0, adv


@pytest.mark.parametrize("value", FLAT)
@pytest.mark.parametrize("chunk", [0, 5], ids=["plain", "fused"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_a_group_of_equal_rewards_gives_exactly_zero_gradient(
    tiny_tokenizer, loss_type, chunk, value
):
    model, prompts, completions = _model_and_rows(tiny_tokenizer, 8)
    objective = GRPO(
        GRPOConfig(
            group_size=8, max_completion_length=16, temperature=TEMPERATURE, loss_type=loss_type
        ),
        TokenLoss(chunk),
        [],
        tiny_tokenizer,
        "prompt",
    )
    adv = grpo_loss.advantages(torch.full((8,), value), 8, "group")
    grads = _grads(model, objective, _batch(tiny_tokenizer, prompts, completions, adv), True)
    for name, g in grads.items():
        assert torch.count_nonzero(g) == 0, name
    # the same rows with rewards that differ do move every weight
    adv = grpo_loss.advantages(torch.arange(8.0), 8, "group")
    grads = _grads(model, objective, _batch(tiny_tokenizer, prompts, completions, adv), True)
    assert all(torch.count_nonzero(g) > 0 for g in grads.values())


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_removing_a_group_of_equal_rewards_leaves_the_gradient_unchanged(
    tiny_tokenizer, loss_type, scale
):
    """A mixed batch and the same batch without its flat group: the summed losses have the same
    gradient, so the step's gradients differ by the normaliser (tokens, rows) alone."""
    model, prompts, completions = _model_and_rows(tiny_tokenizer, 3 * GROUP, seed=1)
    rewards = torch.tensor(REWARDS[:4] + [1.0] * 4 + REWARDS[4:8])  # the middle group is flat
    keep = [i for i in range(3 * GROUP) if not GROUP <= i < 2 * GROUP]
    objective = _objective(tiny_tokenizer, loss_type)

    full = _batch(tiny_tokenizer, prompts, completions, grpo_loss.advantages(rewards, GROUP, scale))
    part = _batch(
        tiny_tokenizer,
        [prompts[i] for i in keep],
        [completions[i] for i in keep],
        grpo_loss.advantages(rewards[keep], GROUP, scale),
    )
    assert torch.count_nonzero(full[ADV][GROUP : 2 * GROUP]) == 0
    g_full, g_part = (_grads(model, objective, b, False) for b in (full, part))
    for name in g_full:
        assert torch.count_nonzero(g_part[name]) > 0, name
        torch.testing.assert_close(
            g_full[name], g_part[name], rtol=1e-5, atol=1e-6 * float(g_part[name].abs().max())
        )
    # normalised as the step normalises: the same direction, scaled by the ratio of the counts
    n_full, n_part = objective.count(full), objective.count(part)
    assert n_full > n_part
    g_full_n, g_part_n = (_grads(model, objective, b, True) for b in (full, part))
    for name in g_full_n:
        torch.testing.assert_close(
            g_full_n[name] * n_full,
            g_part_n[name] * n_part,
            rtol=1e-5,
            atol=1e-6 * float(g_part[name].abs().max()),
        )


# ----------------------------------------------------------------------- the LoRA reference
@pytest.mark.parametrize("chunk", [0, 5], ids=["plain", "fused"])
def test_adapters_off_reference_equals_the_base_models_logps(tiny_tokenizer, chunk):
    from peft import LoraConfig, get_peft_model

    from onegpu.objectives.reference import AdapterReference

    base, prompts, completions = _model_and_rows(tiny_tokenizer, 6, seed=2)
    batch = _batch(tiny_tokenizer, prompts, completions, torch.zeros(6))
    with torch.no_grad():
        expected = TokenLoss(0).policy_logps(base, batch, TEMPERATURE)[1]
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():  # adapters that change the model (LoRA starts as the identity)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    tokens = TokenLoss(chunk)
    with torch.no_grad():
        adapted = tokens.policy_logps(model, batch, TEMPERATURE)[1]
    assert (adapted - expected).abs().max() > 1e-2
    reference = AdapterReference(tokens).token_logps(model, batch, TEMPERATURE)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and the adapters are on again afterwards
        torch.testing.assert_close(tokens.policy_logps(model, batch, TEMPERATURE)[1], adapted)
