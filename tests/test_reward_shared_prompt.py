"""techniques.shared_prompt: a reward model's pair in one row after one copy of its prompt gives
the two-row batch's scores, loss and gradients from fewer tokens, and is refused or left off where
the model cannot take it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import DataConfig, PreferenceConfig
from onegpu.data import pairs
from onegpu.data.batches import Collator
from onegpu.errors import ConfigError
from onegpu.objectives import reward, shared_prompt
from onegpu.objectives.tokens import with_target_positions
from test_preference import PAIRS

LONG = {  # a prompt longer than the others and responses of unequal length: padding in the rows
    "prompt": "def total(values):\n    result = 0\n    for v in values:\n",
    "chosen": "        result += v\n    return result\n",
    "rejected": "v result += \n",
}


def _score_model(tok, attention="sdpa", **extra):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    base = make_tiny_llama(tok)
    config = LlamaConfig(**{**base.config.to_dict(), "num_labels": 1, **extra})
    config._attn_implementation = attention
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(config)
    model.config.pad_token_id = tok.pad_token_id
    return model


def _batch(tok, records, margins=None, shared=True):
    cols = {k: [r[k] for r in records] for k in ("prompt", "chosen", "rejected")}
    if margins is not None:
        cols["margin"] = margins
    out = pairs.tokenize_batch(cols, list(range(len(records))), tok, DataConfig(seq_len=128), "t")
    keys = ["prompt_ids", "chosen_ids", "rejected_ids"] + (["margin"] if margins else [])
    examples = [{k: out[k][i] for k in keys} for i in range(len(records))]
    collator = pairs.PairCollator(Collator(tok.pad_token_id, 8, 128), shared=shared)
    return with_target_positions(collator(examples))


def _widths(model):
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("margins, center", [(None, None), ([0.5, 0.0, -0.2], 0.01)])
def test_shared_rows_give_the_two_row_loss_and_gradients_from_fewer_tokens(
    tiny_tokenizer, attention, margins, center
):
    records = PAIRS[:2] + [LONG]
    batch = _batch(tiny_tokenizer, records, margins)
    model = _score_model(tiny_tokenizer, attention)
    results = {}
    for mode in ("off", "on"):
        m = copy.deepcopy(model).train()
        seen = _widths(m)
        objective = reward.Reward(
            PreferenceConfig(center_rewards_coefficient=center), None, shared=mode
        )
        loss = objective.loss(m, batch) / objective.count(batch)
        loss.backward()
        objective.end_cycle()
        results[mode] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()}, seen)
        results[mode] += (objective.window_metrics(),)
    (off_loss, off_grads, off_seen, off_m), (on_loss, on_grads, on_seen, on_m) = (
        results["off"],
        results["on"],
    )
    assert torch.allclose(on_loss, off_loss, atol=1e-6)
    for name, g in off_grads.items():
        assert torch.allclose(on_grads[name], g, atol=1e-6, rtol=1e-4), name
    assert on_m["reward_accuracy"] == off_m["reward_accuracy"]
    assert on_m["reward_margin"] == pytest.approx(off_m["reward_margin"], abs=1e-6)
    # active: one row per pair, and fewer token positions than two rows each repeating the prompt
    (on_shape,), (off_shape,) = on_seen, off_seen
    assert on_shape[0] == len(records) and off_shape[0] == 2 * len(records)
    real = int(batch["attention_mask"].sum())
    prompt = (batch["labels"] == pairs.IGNORE) & batch["attention_mask"].bool()
    prompts = int(prompt[: len(records)].sum())  # each pair's prompt, counted once
    assert int((batch[shared_prompt.SEGMENTS] != shared_prompt.PAD).sum()) == real - prompts
    assert on_shape[0] * on_shape[1] < off_shape[0] * off_shape[1]


def test_a_response_never_sees_the_other_and_padding_is_seen_by_none():
    seg = torch.tensor([[0, 0, 1, 1, 2, 2, 2, -1]])
    allowed = shared_prompt.mask(seg, torch.float32, additive=False)[0, 0]
    rejected, chosen = slice(4, 7), slice(2, 4)
    assert not allowed[rejected, chosen].any()
    assert allowed[rejected, 0:2].all() and allowed[chosen, 0:2].all()
    assert not allowed[:7, 7].any() and allowed[7, 7]
    assert not allowed[0, 1]  # causal inside the prompt
    additive = shared_prompt.mask(seg, torch.float32, additive=True)[0, 0]
    assert torch.equal(additive == 0, allowed)


def test_each_score_is_the_sequence_scored_alone(tiny_tokenizer):
    tok = tiny_tokenizer
    model = _score_model(tok).eval()
    records = PAIRS[:2] + [LONG]
    batch = _batch(tok, records)
    with torch.no_grad():
        both = shared_prompt.scores(model, batch)
        alone = []
        for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            alone.append(model(input_ids=row[mask.bool()][None]).logits.item())
    n = len(records)
    assert torch.allclose(both[:, 0], torch.tensor(alone[:n]), atol=1e-5)
    assert torch.allclose(both[:, 1], torch.tensor(alone[n:]), atol=1e-5)


@pytest.mark.parametrize(
    "attention, extra, why",
    [
        ("flash_attention_2", {}, "takes no custom mask"),
        ("sdpa", {"sliding_window": 16}, "sliding-window"),
        ("sdpa", {"num_local_experts": 4}, "router loss"),
    ],
)
def test_on_is_refused_where_the_model_cannot_take_it(tiny_tokenizer, attention, extra, why):
    model = _score_model(tiny_tokenizer, "sdpa", **extra)
    model.config._attn_implementation = attention
    assert why in shared_prompt.applies(model)
    with pytest.raises(ConfigError, match="techniques.shared_prompt=on"):
        reward.Reward(PreferenceConfig(), None, shared="on").loss(
            model, _batch(tiny_tokenizer, PAIRS[:2])
        )


def test_auto_keeps_two_rows_where_the_model_cannot_take_them(tiny_tokenizer, caplog):
    model = _score_model(tiny_tokenizer, sliding_window=16)
    seen = _widths(model)
    with caplog.at_level(logging.INFO, logger="onegpu.objectives.reward"):
        reward.Reward(PreferenceConfig(), None, shared="auto").loss(
            model, _batch(tiny_tokenizer, PAIRS[:2])
        )
    assert seen[0][0] == 4  # two rows per pair
    assert any("shared_prompt: off: sliding-window" in r.message for r in caplog.records)


def test_a_model_compiled_whole_is_left_to_its_whole_forward(tiny_tokenizer):
    model = _score_model(tiny_tokenizer)
    assert shared_prompt.applies(model) is None
    assert "compiled whole" in shared_prompt.applies(torch.compile(model, backend="eager"))
    model.compile(backend="eager")  # in place, as techniques.compile_regional=false does
    assert "compiled whole" in shared_prompt.applies(model)
    regional = _score_model(tiny_tokenizer)
    for layer in regional.model.layers:  # regional compile: the blocks, which the rows run too
        layer.compile(backend="eager")
    assert shared_prompt.applies(regional) is None


def test_the_rows_width_is_rounded_as_the_collators_and_trimmed_to_the_same_scores(tiny_tokenizer):
    tok = tiny_tokenizer
    cols = {k: [r[k] for r in PAIRS[:2]] for k in ("prompt", "chosen", "rejected")}
    out = pairs.tokenize_batch(cols, [0, 1], tok, DataConfig(seq_len=128), "t")
    examples = [
        {k: out[k][i] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in (0, 1)
    ]
    batch = pairs.PairCollator(Collator(tok.pad_token_id, 64, 256), shared=True)(examples)
    longest = int(batch[shared_prompt.ENDS].max()) + 1
    assert (
        batch[shared_prompt.INDEX].shape[1] % 64 == 0
        and batch[shared_prompt.INDEX].shape[1] > longest
    )
    model = _score_model(tok).eval()
    seen = _widths(model)
    with torch.no_grad():
        full, trimmed = (shared_prompt.scores(model, batch, trim) for trim in (False, True))
    assert torch.allclose(full, trimmed, atol=1e-5)
    assert [s[1] for s in seen] == [batch[shared_prompt.INDEX].shape[1], longest]


def test_auto_logs_its_choice_once(tiny_tokenizer, caplog):
    model = _score_model(tiny_tokenizer)
    objective = reward.Reward(PreferenceConfig(), None, shared="auto")
    batch = _batch(tiny_tokenizer, PAIRS[:2])
    with caplog.at_level(logging.INFO, logger="onegpu.objectives.reward"):
        objective.loss(model, batch)
        objective.loss(model, batch)
    said = [r.message for r in caplog.records if "shared_prompt" in r.message]
    assert said == ["techniques.shared_prompt: on (one prompt per pair)"]


def test_off_adds_no_layout_to_the_batch(tiny_tokenizer):
    batch = _batch(tiny_tokenizer, PAIRS[:2], shared=False)
    assert not set(shared_prompt.KEYS) & set(batch)


@pytest.mark.parametrize(
    "lora, compile",
    [(False, "off"), (True, "off"), pytest.param(False, "default", marks=pytest.mark.slow)],
)
def test_a_reward_run_trains_the_same_with_shared_rows_as_with_two(
    tmp_path, tiny_model_dir, one_thread, lora, compile
):
    """Whole runs, full, LoRA (the head through PEFT's wrapper) and regionally compiled (the
    decoder blocks by inductor): the same losses and held-out accuracy step by step with
    techniques.shared_prompt on as off."""
    import json

    from onegpu import train
    from test_preference_train import cfg_for

    logged = {}
    for mode in ("off", "on"):
        cfg = cfg_for(tmp_path, tiny_model_dir, "reward", name=mode, lora=lora, max_steps=8)
        cfg["techniques"].update(shared_prompt=mode, compile=compile)
        run = train(cfg).run_dir
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        logged[mode] = [
            (r["split"], r["step"], r["loss"], r.get("reward_accuracy"))
            for r in rows
            if "loss" in r
        ]
    assert len(logged["on"]) == len(logged["off"]) >= 3
    for a, b in zip(logged["on"], logged["off"], strict=True):
        assert a[:2] == b[:2] and a[3] == b[3]
        assert a[2] == pytest.approx(b[2], abs=1e-5), a[:2]
