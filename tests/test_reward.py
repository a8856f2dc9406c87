"""Reward models: the Bradley-Terry loss and gradients equal TRL's RewardTrainer (with and without
a margin column and center_rewards_coefficient, a tied pair included), the same tokens as TRL's,
and a trained model saved by a run loads with AutoModelForSequenceClassification, scores as it
did, and ranks held-out pairs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.config import DataConfig, PreferenceConfig
from onegpu.data import pairs
from onegpu.data.batches import Collator
from onegpu.objectives import reward
from onegpu.objectives.tokens import with_target_positions
from test_preference import PAIRS

TIE = {"prompt": "x = 1\n", "chosen": "y = 2\n", "rejected": "y = 2\n"}  # equal scores: log 2


def _score_model(tok):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    base = make_tiny_llama(tok)
    config = LlamaConfig(**{**base.config.to_dict(), "num_labels": 1})
    torch.manual_seed(1)
    return LlamaForSequenceClassification(config)


def _batch(tok, records, margins=None):
    cfg = DataConfig(seq_len=128)
    cols = {k: [r[k] for r in records] for k in ("prompt", "chosen", "rejected")}
    if margins is not None:
        cols["margin"] = margins
    out = pairs.tokenize_batch(cols, list(range(len(records))), tok, cfg, "t")
    keys = ["prompt_ids", "chosen_ids", "rejected_ids"] + (["margin"] if margins else [])
    examples = [{k: out[k][i] for k in keys} for i in range(len(records))]
    return with_target_positions(pairs.PairCollator(Collator(tok.pad_token_id, 8, 128))(examples))


def _trl_trainer(tok, model, records, tmp, **kw):
    import datasets
    import trl

    args = trl.RewardConfig(
        output_dir=tmp,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=len(records),
        max_length=128,
        dataset_num_proc=None,
        **kw,
    )
    return trl.RewardTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tok,
    )


@pytest.mark.parametrize(
    "margins, center", [(None, None), ([0.5, 0.0, 1.0, -0.2, 0.3], 0.01), (None, 0.1)]
)
def test_reward_loss_and_gradients_equal_trl_rewardtrainer(
    tiny_tokenizer, tmp_path, margins, center
):
    """Same tiny score model, same pairs (a tied pair among them): TRL's RewardTrainer.compute_loss
    and ours give the same loss and the same gradient of every weight."""
    pytest.importorskip("trl")
    records = PAIRS + [TIE]
    if margins is not None:
        records = [{**r, "margin": m} for r, m in zip(records, margins, strict=True)]
    model = _score_model(tiny_tokenizer)
    model.config.pad_token_id = tiny_tokenizer.pad_token_id
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    kw = {} if center is None else {"center_rewards_coefficient": center}
    trainer = _trl_trainer(tiny_tokenizer, theirs, records, str(tmp_path), **kw)
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trl_loss = trainer.compute_loss(trainer.model, trl_batch)
    trl_loss.backward()

    loss_fn = reward.Reward(PreferenceConfig(center_rewards_coefficient=center), None)
    batch = _batch(tiny_tokenizer, records, margins)

    # TRL's rows are the whole sequences it tokenized: ours are prompt + response, the same ids
    def rows(b):
        return [
            r[m.bool()].tolist() for r, m in zip(b["input_ids"], b["attention_mask"], strict=True)
        ]

    assert rows(batch) == rows(trl_batch)
    ours.train()
    our_loss = loss_fn.loss(ours, batch) / loss_fn.count(batch)
    our_loss.backward()
    assert float(our_loss) == pytest.approx(float(trl_loss), abs=1e-6)
    grads = dict(trainer.model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4), name
    loss_fn.end_cycle()
    metrics = loss_fn.window_metrics()
    assert metrics["reward_accuracy"] == pytest.approx(trainer._metrics["train"]["accuracy"][-1])
    assert metrics["reward_margin"] == pytest.approx(
        trainer._metrics["train"]["margin"][-1], abs=1e-6
    )


def test_a_tied_pair_costs_log_2_and_no_gradient_from_its_difference():
    r = torch.tensor([0.3, 0.3], requires_grad=True)
    loss = reward.bradley_terry_loss(r[:1], r[1:])
    loss.sum().backward()
    assert float(loss) == pytest.approx(0.6931, abs=1e-4)
    assert float(r.grad.sum()) == pytest.approx(0.0, abs=1e-7)  # +g and -g: no net push


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_trained_reward_model_loads_with_automodelforsequenceclassification(
    tmp_path, tiny_model_dir, one_thread
):
    """From a causal LM checkpoint: the run adds the score head, trains it on pairs, logs accuracy
    and margin, and saves a model that AutoModelForSequenceClassification loads with the scores the
    run's model gave."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from onegpu import train
    from onegpu.report import read_metrics
    from test_preference_train import cfg_for

    cfg = cfg_for(tmp_path, tiny_model_dir, "reward", max_steps=16, lr=1e-3)
    result = train(cfg)
    recs = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["split"] == "train"]
    assert all({"reward_accuracy", "reward_margin"} <= r.keys() for r in recs)
    assert recs[-1]["reward_margin"] > recs[0]["reward_margin"]
    assert recs[-1]["loss"] < recs[0]["loss"]
    final = result.run_dir / "final"
    model = AutoModelForSequenceClassification.from_pretrained(str(final)).eval()
    tok = AutoTokenizer.from_pretrained(str(final))
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    batch = _batch(tok, PAIRS)
    with torch.no_grad():
        scores = reward.scores(model, batch)[1]
    assert scores.shape == (2 * len(PAIRS),) and torch.isfinite(scores).all()
    val = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["split"] == "val"]
    assert val[-1]["reward_accuracy"] >= 0.75  # held-out pairs ranked


def test_grpo_scores_with_a_reward_model_folder_as_trl_does(tiny_tokenizer, tmp_path):
    """grpo.rewards takes a reward model's folder: each prompt + completion scored by the head, the
    same numbers as TRL's GRPOTrainer computes for a model reward (texts tokenized without special
    tokens, right-padded, logits[:, 0]), in batches; a folder of a causal LM is a clear error."""
    from onegpu.config import GRPOConfig
    from onegpu.errors import ConfigError
    from onegpu.objectives import reward_model, rewards

    model = _score_model(tiny_tokenizer)
    model.config.pad_token_id = tiny_tokenizer.pad_token_id
    folder = tmp_path / "rm"
    model.save_pretrained(str(folder))
    tiny_tokenizer.save_pretrained(str(folder))
    (fn,) = rewards.resolve(GRPOConfig(rewards=[str(folder)]))
    prompts = [r["prompt"] for r in PAIRS] * 10  # 40 texts: two batches of reward_model.BATCH
    completions = [r["chosen"] for r in PAIRS] * 10
    got = fn.fn(prompts=prompts, completions=completions, completion_ids=[[0]] * 40)
    enc = tiny_tokenizer(
        [p + c for p, c in zip(prompts, completions, strict=True)],
        return_tensors="pt",
        padding=True,
        padding_side="right",
        add_special_tokens=False,
    )
    with torch.no_grad():
        expected = model.eval()(**enc).logits[:, 0]
    assert len(got) == 40 > reward_model.BATCH
    assert torch.allclose(torch.tensor(got), expected, atol=1e-5)
    lm = tmp_path / "lm"
    make_tiny_llama(tiny_tokenizer).save_pretrained(str(lm))
    with pytest.raises(ConfigError, match="not a reward model"):
        rewards.resolve(GRPOConfig(rewards=[str(lm)]))


def test_a_lora_reward_model_trains_its_score_head_whole(tmp_path, tiny_model_dir, one_thread):
    """With LoRA the score head is new, so it trains whole (PEFT's SEQ_CLS task: modules_to_save)
    and the saved adapter carries it: the base loaded with one label plus the adapter scores."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from onegpu import train
    from test_preference_train import cfg_for

    result = train(cfg_for(tmp_path, tiny_model_dir, "reward", lora=True, max_steps=4))
    final = result.run_dir / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in (adapter["modules_to_save"] or [])
    saved = load_file(str(final / "adapter_model.safetensors"))
    assert any("score" in k for k in saved) and any("lora_A" in k for k in saved)
    base = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    tok = AutoTokenizer.from_pretrained(str(final))
    base.config.pad_token_id = tok.pad_token_id
    model = PeftModel.from_pretrained(base, str(final)).eval()
    with torch.no_grad():
        scores = reward.scores(model, _batch(tok, PAIRS))[1]
    assert scores.shape == (2 * len(PAIRS),) and torch.isfinite(scores).all()


def test_an_eager_cpu_step_leaves_out_the_all_padding_columns_with_the_same_loss_and_gradients(
    tiny_tokenizer,
):
    """The collator rounds the width up to 64; trimmed, the model sees only the longest row's
    columns, and the loss and every gradient are those of the padded batch (right padding, causal
    attention, the head at each row's last real token)."""
    tok = tiny_tokenizer
    cols = {k: [r[k] for r in PAIRS] for k in ("prompt", "chosen", "rejected")}
    out = pairs.tokenize_batch(cols, list(range(len(PAIRS))), tok, DataConfig(seq_len=128), "t")
    examples = [
        {k: out[k][i] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(PAIRS))
    ]
    batch = with_target_positions(pairs.PairCollator(Collator(tok.pad_token_id, 64, 128))(examples))
    longest = int(batch["attention_mask"].sum(1).max())
    assert batch["input_ids"].shape[1] == 64 > longest  # padding in every row to leave out
    grads, losses = [], []
    for trim in (False, True):
        model = _score_model(tok)
        model.config.pad_token_id = tok.pad_token_id
        widths = []
        model.model.embed_tokens.register_forward_hook(
            lambda m, a, o, seen=widths: seen.append(a[0].shape[1])
        )
        loss = reward.Reward(PreferenceConfig(), None, trim=trim).loss(model, batch)
        loss.backward()
        assert widths == [longest if trim else 64]
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_each_row_is_scored_at_its_last_real_token(tiny_tokenizer):
    """The head reads each row's last non-padding token (the EOS that ends every sequence), so a
    row scores the same alone as padded in a batch beside longer rows."""
    tok = tiny_tokenizer
    model = _score_model(tok).eval()
    model.config.pad_token_id = tok.pad_token_id
    batch = _batch(tok, PAIRS)
    with torch.no_grad():
        _, got = reward.scores(model, batch)
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        assert (batch["input_ids"][torch.arange(len(last)), last] == tok.eos_token_id).all()
        want = model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)
        alone = [
            model(input_ids=batch["input_ids"][i : i + 1, : last[i] + 1]).logits.item()
            for i in range(len(last))
        ]
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got, torch.tensor(alone), atol=1e-5)
    assert int(batch["attention_mask"].sum(1).min()) < batch["input_ids"].shape[1]  # padded rows
