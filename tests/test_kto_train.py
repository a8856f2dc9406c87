"""KTO end to end: with LoRA (adapters-off reference) on labelled completions and full (precomputed
reference) on preference pairs split in two, the rewards of desirable completions rise above the
undesirable ones'; the default job's pairs become desirable and undesirable examples; bad setups
are one clear error."""

from __future__ import annotations

import json

import pytest

from onegpu import train
from onegpu.config import from_dict, validate
from onegpu.errors import ConfigError, DataError
from onegpu.report import read_metrics
from test_preference_train import cfg_for, write_pairs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


def _write_unpaired(path, pairs_path):
    """The pairs file as labelled completions: chosen desirable, rejected undesirable, alternating
    prompts so no example's neighbour is its own pair."""
    rows = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    out = [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
    out += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in rows]
    out = [out[i // 2 + (len(rows) if i % 2 else 0)] for i in range(len(out))]
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def _train_records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]


def _assert_learns(result):
    recs = _train_records(result.run_dir)
    assert all({"reward_accuracy", "reward_margin", "kl"} <= r.keys() for r in recs)
    first, last = recs[0], recs[-1]
    assert last["reward_margin"] > max(first["reward_margin"], 0)
    assert last["reward_accuracy"] >= max(first["reward_accuracy"], 0.75)
    assert last["loss"] < first["loss"]


def test_kto_with_lora_on_labelled_completions_learns(tmp_path, tiny_model_dir):
    cfg = cfg_for(tmp_path, tiny_model_dir, "kto", lora=True, max_steps=24)
    pairs = tmp_path / "pairs.jsonl"
    cfg["data"]["path"] = str(_write_unpaired(tmp_path / "kto.jsonl", pairs))
    result = train(cfg)
    _assert_learns(result)
    assert not (result.run_dir / "reference_logps.safetensors").exists()  # adapters off
    val = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["split"] == "val"]
    assert val[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # policy == reference: 1 - sigmoid(0)


def test_full_kto_on_pairs_with_a_precomputed_reference_learns(tmp_path, tiny_model_dir):
    result = train(cfg_for(tmp_path, tiny_model_dir, "kto", max_steps=24))
    _assert_learns(result)
    from safetensors.torch import load_file

    saved = load_file(str(result.run_dir / "reference_logps.safetensors"))
    assert set(saved) == {
        f"{split}.{col}"
        for split in ("train", "validation")
        for col in ("ref_completion_logps", "ref_kl_logps")
    }
    assert all((v < 0).all() for v in saved.values())


def test_the_default_pairs_become_desirable_and_undesirable_examples(tmp_path):
    """With no data, KTO trains on the standard library's pairs, each as one desirable and one
    undesirable example, in an order where no example follows its own pair's other half."""
    from onegpu.training.data import read_records

    cfg = validate(
        from_dict(
            {
                "training": {"objective": "kto", "max_steps": 4, "micro_batch_size": 4},
                "data": {"max_bytes": 200_000},
            }
        )
    )
    recs = read_records(cfg)
    assert recs.format == "unpaired"
    train_rec = recs.train
    labels = train_rec["label"]
    assert len(train_rec) == 2 * 4 * 4 and sum(labels) == len(labels) // 2
    prompts = train_rec["prompt"]
    assert all(prompts[i] != prompts[i - 1] for i in range(len(prompts)))


def test_kto_setups_that_cannot_work_are_clear_errors(tmp_path, tiny_model_dir, text_file):
    with pytest.raises(ConfigError, match="micro_batch_size >= 2"):
        validate(from_dict({"training": {"objective": "kto", "micro_batch_size": 1}}))
    with pytest.raises(ConfigError, match="undesirable_weight must be positive"):
        validate(from_dict({"preference": {"undesirable_weight": 0}}))
    cfg = cfg_for(tmp_path, tiny_model_dir, "kto")
    cfg["data"]["path"] = str(text_file)
    with pytest.raises(DataError, match="kto needs labelled completions"):
        train(cfg)


def test_sft_reads_labelled_completions_as_prompt_completion(tmp_path, tiny_model_dir):
    """A label column makes records KTO's only for KTO: SFT trains on their prompt/completion."""
    from onegpu.training.data import read_records

    write_pairs(tmp_path / "pairs.jsonl")
    path = _write_unpaired(tmp_path / "kto.jsonl", tmp_path / "pairs.jsonl")
    cfg = cfg_for(tmp_path, tiny_model_dir, "sft")
    cfg["data"]["path"] = str(path)
    assert read_records(validate(from_dict(cfg))).format == "prompt_completion"
