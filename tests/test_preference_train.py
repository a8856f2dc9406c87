"""Preference tuning end to end: DPO with LoRA (adapters-off reference) and full DPO (precomputed
reference) from the command line with a rising reward accuracy, ORPO/SimPO runs, accumulation
normalised by pairs, an out-of-memory retry that keeps the effective batch, bitwise resume, and bad
pair data."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from helpers import CORPUS
from onegpu import train
from onegpu.errors import DataError
from onegpu.report import read_metrics
from onegpu.training import assemble

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


def _shuffled(text: str, rng: random.Random) -> str:
    words = text.split()
    while len(words) > 1:
        rng.shuffle(words)
        if " ".join(words) != " ".join(text.split()):
            break
    return " ".join(words) + "\n"


def write_pairs(path, n: int = 48, chat: bool = False):
    rng = random.Random(0)
    snippets = [c for c in dict.fromkeys(CORPUS) if "\n" in c.strip()]
    with open(path, "w") as f:
        for i in range(n):
            head, _, rest = snippets[i % len(snippets)].partition("\n")
            rec = {"prompt": head + "\n", "chosen": rest, "rejected": _shuffled(rest, rng)}
            if chat:
                rec = {
                    "prompt": [{"role": "user", "content": head}],
                    "chosen": [{"role": "assistant", "content": rest}],
                    "rejected": [{"role": "assistant", "content": rec["rejected"]}],
                }
            f.write(json.dumps(rec) + "\n")
    return path


def cfg_for(tmp_path, model_dir, objective="dpo", name="run", lora=False, **training):
    data = tmp_path / "pairs.jsonl"
    if not data.exists():
        write_pairs(data)
    t = dict(
        objective=objective,
        micro_batch_size=4,
        grad_accum=1,
        max_steps=16,
        eval_every=8,
        eval_batches=2,
        log_every=4,
        lr=3e-3 if lora else 1e-3,
        warmup_steps=0,
        seed=3,
    )
    t.update(training)
    return {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "seq_len": 64, "num_proc": 1, "val_fraction": 0.15},
        "training": t,
        "techniques": {"lora": {"enabled": lora, "r": 8}, "compile": "off"},
        "output": {
            "dir": str(tmp_path / "runs"),
            "name": name,
            "report_to": "none",
            "keep_last": 10,
        },
    }


def train_records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]


def _assert_learns(result):
    recs = train_records(result.run_dir)
    assert all(
        {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= r.keys()
        for r in recs
    )
    first, last = recs[0], recs[-1]
    assert last["reward_margin"] > first["reward_margin"] and last["reward_margin"] > 0
    assert last["reward_accuracy"] >= max(first["reward_accuracy"], 0.75)
    assert last["loss"] < first["loss"]


def test_dpo_with_lora_from_the_cli_raises_the_reward_accuracy(tmp_path, tiny_model_dir, capsys):
    from onegpu.cli.main import main

    write_pairs(tmp_path / "pairs.jsonl")
    run = tmp_path / "runs" / "cli"
    code = main(
        [
            "train",
            "--model.name",
            str(tiny_model_dir),
            "--data.path",
            str(tmp_path / "pairs.jsonl"),
            "--data.seq_len",
            "64",
            "--data.num_proc",
            "1",
            "--training.objective",
            "dpo",
            "--techniques.lora.enabled",
            "true",
            "--techniques.lora.r",
            "8",
            "--training.lr",
            "3e-3",
            "--training.micro_batch_size",
            "4",
            "--training.max_steps",
            "16",
            "--training.log_every",
            "4",
            "--training.warmup_steps",
            "0",
            "--training.eval_every",
            "8",
            "--techniques.compile",
            "off",
            "--output.dir",
            str(tmp_path / "runs"),
            "--output.name",
            "cli",
            "--output.report_to",
            "none",
        ]
    )
    assert code == 0
    recs = train_records(run)
    assert (
        recs[-1]["reward_accuracy"] > recs[0]["reward_accuracy"]
        or recs[-1]["reward_accuracy"] == 1.0
    )
    assert recs[-1]["reward_margin"] > recs[0]["reward_margin"] > -1e-6
    assert not (
        run / "reference_logps.safetensors"
    ).exists()  # the reference is the base: adapters off
    assert (run / "final" / "adapter_config.json").is_file()
    val = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "val"]
    assert val[0]["loss"] == pytest.approx(
        0.6931, abs=1e-3
    )  # policy == reference before the first step


def test_full_dpo_with_precomputed_reference_learns_and_keeps_the_reference(
    tmp_path, tiny_model_dir
):
    result = train(cfg_for(tmp_path, tiny_model_dir))
    _assert_learns(result)
    from safetensors.torch import load_file

    saved = load_file(str(result.run_dir / "reference_logps.safetensors"))
    assert set(saved) == {
        "train.ref_chosen_logps",
        "train.ref_rejected_logps",
        "validation.ref_chosen_logps",
        "validation.ref_rejected_logps",
    }
    assert all(torch.isfinite(v).all() and (v < 0).all() for v in saved.values())


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_learn(tmp_path, tiny_model_dir, objective):
    result = train(cfg_for(tmp_path, tiny_model_dir, objective, lr=2e-3))
    _assert_learns(result)
    assert not (result.run_dir / "reference_logps.safetensors").exists()


def test_dpo_on_chat_pairs_trains_on_the_responses(tmp_path, tiny_model_dir, tiny_tokenizer):
    write_pairs(tmp_path / "pairs.jsonl", chat=True)
    result = train(cfg_for(tmp_path, tiny_model_dir, max_steps=2, eval_every=0))
    assert result.state.step == 2 and result.run_dir.joinpath("final").is_dir()


def test_accumulation_and_oom_retry_keep_the_pair_batch(tmp_path, tiny_model_dir, monkeypatch):
    """4 pairs x 1, 2 pairs x 2 and 4 pairs x 1 that runs out of memory above 2 pairs (retried as 2
    x 2) train the same: the loss is a mean over the pairs of the whole accumulated batch."""
    whole = train(
        cfg_for(tmp_path, tiny_model_dir, name="whole", max_steps=4, eval_every=0, log_every=1)
    )
    accum = train(
        cfg_for(
            tmp_path,
            tiny_model_dir,
            name="accum",
            max_steps=4,
            eval_every=0,
            log_every=1,
            micro_batch_size=2,
            grad_accum=2,
        )
    )

    real = assemble.make_objective

    class OomAbove2:
        def __init__(self, fn):
            self.fn = fn

        def __getattr__(self, name):
            return getattr(self.fn, name)

        def loss(self, model, batch):
            if model.training and self.fn.count(batch) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return self.fn.loss(model, batch)

    monkeypatch.setattr(assemble, "make_objective", lambda *a: OomAbove2(real(*a)))
    retried = train(
        cfg_for(tmp_path, tiny_model_dir, name="oom", max_steps=4, eval_every=0, log_every=1)
    )
    assert (retried.state.micro_batch_size, retried.state.grad_accum) == (2, 2)
    base = [r[k] for r in train_records(whole.run_dir) for k in ("loss", "reward_margin")]
    assert base[-2] < base[0]  # it trained
    for other in (accum, retried):
        got = [r[k] for r in train_records(other.run_dir) for k in ("loss", "reward_margin")]
        assert got == pytest.approx(base, rel=1e-4, abs=1e-6)


def test_dpo_resume_is_bitwise_and_reads_the_saved_reference(tmp_path, tiny_model_dir):
    from helpers import assert_same_weights

    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=6, eval_every=3, log_every=1, save_every=3)
    first = train(cfg)
    straight = [
        (r["split"], r["step"], r["loss"]) for r in read_metrics(first.run_dir / "metrics.jsonl")
    ]
    import shutil

    shutil.copytree(first.run_dir / "final", tmp_path / "final-straight")
    cfg["output"]["resume"] = str(first.run_dir / "checkpoint-00000003")
    second = train(cfg)
    resumed = [
        (r["split"], r["step"], r["loss"]) for r in read_metrics(second.run_dir / "metrics.jsonl")
    ]
    assert resumed == straight
    assert_same_weights(tmp_path / "final-straight", second.run_dir / "final")


def test_resume_without_the_saved_reference_is_one_clear_error(tmp_path, tiny_model_dir):
    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=2, eval_every=0, save_every=1)
    first = train(cfg)
    (first.run_dir / "reference_logps.safetensors").unlink()
    cfg["output"]["resume"] = "latest"
    with pytest.raises(DataError, match="reference_logps.safetensors is missing"):
        train(cfg)


@pytest.mark.parametrize(
    "record, match",
    [
        ({"prompt": "a", "chosen": 3, "rejected": "b"}, r"pairs.jsonl:2: 'chosen' must be text"),
        (
            {"prompt": "a", "chosen": [{"role": "bot", "content": "x"}], "rejected": "b"},
            r"pairs.jsonl:2, 'chosen'",
        ),
    ],
)
def test_bad_pair_records_name_the_record(tmp_path, tiny_model_dir, record, match):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "def f():\n", "chosen": "    return 1\n", "rejected": "return f 1\n"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n" + json.dumps(good) * 0)
    cfg = cfg_for(tmp_path, tiny_model_dir, max_steps=1)
    cfg["data"]["val_fraction"] = 0
    with pytest.raises(DataError, match=match):
        train(cfg)
    assert not (tmp_path / "runs" / "run").exists()


def test_sft_on_pair_data_and_dpo_on_text_are_clear_errors(tmp_path, tiny_model_dir, text_file):
    write_pairs(tmp_path / "pairs.jsonl")
    cfg = cfg_for(tmp_path, tiny_model_dir, objective="sft")
    with pytest.raises(DataError, match=re.escape("set --training.objective dpo")):
        train(cfg)
    cfg = cfg_for(tmp_path, tiny_model_dir)
    cfg["data"]["path"] = str(text_file)
    with pytest.raises(DataError, match="needs preference pairs"):
        train(cfg)


@pytest.mark.parametrize(
    "techniques, tol",
    [
        ({"checkpointing": "full"}, 1e-5),
        ({"compile": "default"}, 1e-4),
        ({"precision": "bf16"}, None),
        ({"optimizer": "adamw-8bit"}, None),
        ({"padding_free": True}, 1e-4),
        ({"lora": {"enabled": True, "r": 8, "quantize_base": "nf4"}}, None),
    ],
    ids=["checkpointing", "compile", "bf16", "adamw-8bit", "padding-free", "qlora"],
)
def test_dpo_runs_with_each_method(tmp_path, tiny_model_dir, techniques, tol):
    """Checkpointing and compile leave the math as it was; bf16 autocast and an 8-bit optimizer
    train."""
    if techniques.get("optimizer") == "adamw-8bit" or "lora" in techniques:
        pytest.importorskip("bitsandbytes")
    base = train(
        cfg_for(tmp_path, tiny_model_dir, name="base", max_steps=6, eval_every=0, log_every=1)
    )
    cfg = cfg_for(tmp_path, tiny_model_dir, name="method", max_steps=6, eval_every=0, log_every=1)
    cfg["techniques"].update(techniques)
    other = train(cfg)
    a = [r[k] for r in train_records(base.run_dir) for k in ("loss", "reward_margin")]
    b = [r[k] for r in train_records(other.run_dir) for k in ("loss", "reward_margin")]
    if tol is not None:
        assert b == pytest.approx(a, rel=tol, abs=tol)
    else:
        assert all(map(lambda x: x == x, b)) and b[-1] > 0 and b[-2] < b[0]
