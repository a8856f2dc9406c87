"""The planner on preference tuning: a pair is two sequences through the model, DPO's reference
costs a forward per step (adapters off, a copy) or nothing per step (precomputed), a copy costs its
weights."""

from __future__ import annotations

import dataclasses

import pytest

from onegpu.config import Config, from_dict
from onegpu.hardware import find_gpu
from onegpu.plan import make_plan, memory, speed
from onegpu.plan.arch import flops_per_token, forward_flops_per_token, model_shape
from onegpu.plan.candidate import setup


@pytest.fixture(scope="module")
def shape():
    return model_shape("tiny")


def test_a_pair_batch_holds_the_activations_of_twice_the_sequences(shape):
    sft = memory.estimate(shape, setup(8, 1, precision="bf16", loss_chunk_size=256), 256)
    pairs = memory.estimate(
        shape,
        setup(
            4,
            1,
            precision="bf16",
            loss_chunk_size=256,
            training={"objective": "dpo"},
            preference={"reference": "precomputed"},
        ),
        256,
    )
    assert pairs.components["activations"] == pytest.approx(sft.components["activations"])
    assert pairs.components["weights"] == sft.components["weights"]


def test_a_reference_copy_costs_the_weights_once_more(shape):
    base = setup(
        4,
        1,
        precision="bf16",
        training={"objective": "dpo"},
        preference={"reference": "precomputed"},
    )
    copy = dataclasses.replace(
        base, preference=dataclasses.replace(base.preference, reference="copy")
    )
    a, b = memory.estimate(shape, base, 256), memory.estimate(shape, copy, 256)
    assert b.components["reference copy"] == shape.params * 4  # fp32 weights under bf16 autocast
    assert b.peak - a.peak == pytest.approx(shape.params * 4)


def test_the_reference_forward_is_counted_per_step_unless_precomputed(shape):
    sft = speed.flops_per_token(shape, setup(8, 1, precision="bf16", lora={"r": 16}), 256)
    lora = setup(
        4, 1, precision="bf16", lora={"r": 16}, training={"objective": "dpo"}
    )  # auto with LoRA: adapters off
    assert lora.reference_kind == "adapters"
    assert speed.flops_per_token(shape, lora, 256) == pytest.approx(
        sft + forward_flops_per_token(shape, 256)
    )
    full = setup(4, 1, precision="bf16", training={"objective": "dpo"})
    assert full.reference_kind == "precomputed"
    assert speed.flops_per_token(shape, full, 256) == pytest.approx(flops_per_token(shape, 256))
    assert any("precomputed" in a for a in speed.assumptions(full, find_gpu("A100"), False))
    orpo = setup(4, 1, precision="bf16", training={"objective": "orpo"})
    assert orpo.reference_kind is None and orpo.rows_per_example == 2


def test_tokens_per_second_count_both_sequences_of_a_pair(shape):
    gpu = find_gpu("A100")
    sft = speed.estimate(shape, setup(8, 2, precision="bf16"), 256, gpu)
    pairs = speed.estimate(
        shape, setup(4, 2, precision="bf16", training={"objective": "simpo"}), 256, gpu
    )
    assert pairs.tokens_per_s == pytest.approx(sft.tokens_per_s, rel=1e-6)  # same rows, same work


def test_plan_for_dpo_keeps_the_pair_batch_and_the_objective():
    cfg = from_dict(
        {
            "training": {"objective": "dpo", "micro_batch_size": 4, "grad_accum": 2},
            "techniques": {"lora": {"enabled": True}},
        }
    )
    plan, rec = make_plan(cfg, "tiny", "A100", 256)
    assert rec is not None and rec.training.objective == "dpo"
    assert rec.training.micro_batch_size * rec.training.grad_accum == 8  # pairs, kept exactly
    assert all(r.candidate.training.objective == "dpo" for r in plan.rows)
    assert isinstance(Config().preference.reference, str)


def test_kto_counts_its_mismatched_forward_and_the_references_two(shape):
    """A KTO example is one trained sequence plus a no-grad forward of its mismatched sequence;
    with LoRA the reference (adapters off) runs both again; precomputed, neither."""
    sft = speed.flops_per_token(shape, setup(8, 1, precision="bf16", lora={"r": 16}), 256)
    fwd = forward_flops_per_token(shape, 256)
    lora = setup(4, 1, precision="bf16", lora={"r": 16}, training={"objective": "kto"})
    assert lora.reference_kind == "adapters" and lora.rows_per_example == 1
    assert speed.flops_per_token(shape, lora, 256) == pytest.approx(sft + 3 * fwd)
    full = setup(4, 1, precision="bf16", training={"objective": "kto"})
    assert full.reference_kind == "precomputed"
    assert speed.flops_per_token(shape, full, 256) == pytest.approx(
        flops_per_token(shape, 256) + fwd
    )
    kto_mem = memory.estimate(shape, full, 256)
    sft_mem = memory.estimate(shape, setup(4, 1, precision="bf16"), 256)
    assert kto_mem.components["activations"] == pytest.approx(sft_mem.components["activations"])


def test_a_reward_model_is_planned_without_its_lm_head():
    """training.objective reward: the shape holds the score head (hidden x 1) in place of the LM
    head, the step no vocabulary logits, and a pair is two sequences."""
    from onegpu.plan.arch import model_shape

    lm = model_shape("small", vocab_size=4096)
    rm = model_shape("small", vocab_size=4096, score_head=True)
    head = lm.vocab * lm.hidden
    assert not rm.tied and lm.tied  # the preset ties its head to the token table
    assert rm.params == lm.params + lm.hidden  # tied: the table stays, the score head is added
    assert rm.active_params == lm.active_params - head + lm.hidden
    c = setup(4, 1, precision="bf16", training={"objective": "reward"})
    assert c.rows_per_example == 2 and c.reference_kind is None
    est = memory.estimate(rm, c, 256)
    sft = memory.estimate(lm, setup(8, 1, precision="bf16"), 256)
    assert est.peak < sft.peak  # no tokens x vocab logits
