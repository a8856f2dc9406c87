"""`onegpu bench train --objective dpo`: onegpu's DPO arms next to TRL's DPOTrainer on the same
pairs, each arm trained for real, the reference pass timed on its own and charged in a column of its
own."""

from __future__ import annotations

import json

import pytest

from onegpu.bench import train as bench_train
from onegpu.bench import train_report
from onegpu.bench.settings import BenchTrainConfig
from onegpu.errors import ConfigError

DPO_ARMS = ["baseline", "lora", "ref-copy", "trl-dpo", "trl-dpo-lora"]


def dpo_bench(tmp_path, **kw) -> BenchTrainConfig:
    """The bench's own model (the tiny preset, from scratch, with its tokenizer trained on the
    corpus) on the default pairs, which fit its 256 positions; 2 pairs a micro-batch, 2 steps, 1
    round."""
    b = BenchTrainConfig()
    b.training.objective = "dpo"
    b.data.seq_len, b.data.max_bytes = 256, 200_000
    b.training.micro_batch_size, b.training.grad_accum, b.training.max_steps = 2, 1, 2
    b.bench.warmup_steps, b.bench.reps, b.bench.max_seconds = 1, 1, 60
    b.bench.out, b.bench.name = str(tmp_path / "results"), "dpo"
    for dotted, value in kw.items():
        section, key = dotted.split("__")
        setattr(getattr(b, section), key, value)
    return b


def test_dry_run_lists_the_dpo_arms(capsys, tmp_path):
    """`--objective dpo` (short for --training.objective) swaps the arm table for DPO's, with TRL's
    DPOTrainer as the peer; nothing is trained or written."""
    from onegpu.cli.main import main

    assert (
        main(
            [
                "bench",
                "train",
                "--objective",
                "dpo",
                "--bench.dry_run",
                "true",
                "--bench.out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    listed = {
        line.split()[0]: line.split(None, 1)[1]
        for line in out.splitlines()
        if line.startswith("  ")
    }
    assert list(listed) == DPO_ARMS
    assert (
        listed["trl-dpo"] == "TRL DPOTrainer" and listed["lora"] == "techniques.lora.enabled=True"
    )
    assert listed["ref-copy"] == "preference.reference=copy" and "objective dpo" in out
    assert not any(tmp_path.iterdir())


def test_objectives_without_a_peer_are_refused():
    b = BenchTrainConfig()
    b.training.objective = "simpo"
    with pytest.raises(ConfigError, match="sft, dpo, grpo, kto or reward") as err:
        bench_train.validate(b)
    assert err.value.hint


@pytest.mark.slow
def test_every_dpo_arm_trains_on_the_same_pairs_and_reports_speed_and_memory(tmp_path):
    """Real children, 2 steps each: every arm counts the same real tokens (TRL tokenized the same
    records into the same ids), writes tokens/s and memory; the precomputed reference is reported
    apart and charged only in its own column; the full arms start from the same weights, so their
    losses agree."""
    paths = bench_train.run(dpo_bench(tmp_path))
    doc = json.loads(paths["json"].read_text())
    assert [s["arm"] for s in doc["schedule"]] == DPO_ARMS
    assert doc["setup"]["data_format"] == "preference"
    arms = doc["arms"]
    for name in DPO_ARMS:
        a = arms[name]
        assert a["status"] == "ok", (name, a.get("reason"))
        (r,) = a["reps"]
        assert r["steps_done"] == 2 and r["timed_steps"] == 1, name
        assert r["tokens_per_s"] > 0 and r["train_mem_mb"] > 0 and r["peak_mem_mb"] > 0, name
        assert r["tokens_seen"] == arms["baseline"]["reps"][0]["tokens_seen"] > 0, name
        assert r["timed_tokens"] == arms["baseline"]["reps"][0]["timed_tokens"] > 0, name
    ev = {name: arms[name]["reps"][0]["evidence"] for name in DPO_ARMS}
    assert (
        ev["baseline"]["reference"] == "precomputed"
        and ev["ref-copy"]["reference"] == "CopyReference"
    )
    assert ev["lora"]["reference"] == "AdapterReference" and ev["lora"]["peft"] is True
    # TRL at its defaults: checkpointing, a frozen copy as reference (this model has no path to load
    # it from)
    assert ev["trl-dpo"]["same_tokens"] is True and ev["trl-dpo"]["checkpointing"] is True
    assert ev["trl-dpo"]["reference"].startswith("frozen copy")
    assert (
        ev["trl-dpo"]["precision"] == "fp32" and ev["trl-dpo"]["precompute_ref_log_probs"] is False
    )
    assert (
        ev["trl-dpo-lora"]["peft"] is True
        and ev["trl-dpo-lora"]["trainable_params"] == ev["lora"]["trainable_params"]
    )

    ref = arms["baseline"]["reps"][0]["reference_pass"]
    assert (
        ref["seconds"] > 0 and ref["warm_seconds"] > 0 and ref["pairs"] >= 2 and ref["tokens"] > 0
    )
    assert all("reference_pass" not in arms[n]["reps"][0] for n in DPO_ARMS[1:])
    assert arms["baseline"]["tokens_per_s_with_ref"] < arms["baseline"]["tokens_per_s"]
    assert arms["trl-dpo"]["tokens_per_s_with_ref"] == arms["trl-dpo"]["tokens_per_s"]
    for name in ("ref-copy", "trl-dpo"):  # the same start, data and schedule as the baseline
        assert arms[name]["final_loss"] == pytest.approx(
            arms["baseline"]["final_loss"], rel=1e-3
        ), name
    assert arms["trl-dpo-lora"]["final_loss"] == pytest.approx(arms["lora"]["final_loss"], rel=1e-3)
    assert set(doc["vs_trl_dpo"]) == {"baseline", "ref-copy"} and set(doc["vs_trl_dpo_lora"]) == {
        "lora"
    }

    md = paths["md"].read_text()
    assert "(eager) vs TRL DPOTrainer (defaults) (eager):" in md and "with its reference pass" in md
    assert "| trl-dpo | TRL DPOTrainer, defaults, full" in md and "in every step" in md
    assert "Set on TRL's side to the run's values" in md


def test_trl_loads_its_own_reference_where_the_model_has_a_path(tiny_model_dir, tiny_tokenizer):
    """TRL's default for a full fine-tune loads a second copy from the policy's path: the bench
    leaves it to TRL for a saved model (the GPU presets), hands over a copy for one built in memory,
    and gives none with LoRA (TRL switches the adapters off)."""
    from transformers import AutoModelForCausalLM

    from helpers import make_tiny_llama
    from onegpu.bench.train_trl import default_reference

    saved = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert default_reference(saved, lora=False) is None
    built = make_tiny_llama(tiny_tokenizer)
    copy = default_reference(built, lora=False)
    assert copy is not built and all(
        (a == b).all() for a, b in zip(copy.parameters(), built.parameters(), strict=True)
    )
    assert default_reference(built, lora=True) is None


def test_reference_pass_is_charged_pro_rata_to_the_timed_steps():
    """The pass covers the pairs of all max_steps steps: 4 of 10 steps timed carry 4/10 of its warm
    time."""
    rep = {
        "timed_tokens": 1000,
        "timed_seconds": 2.0,
        "timed_steps": 4,
        "reference_pass": {"seconds": 9.0, "warm_seconds": 1.0},
    }
    assert train_report.with_reference_pass(rep, 10) == pytest.approx(1000 / 2.4)
    assert train_report.with_reference_pass({**rep, "reference_pass": None}, 10) == pytest.approx(
        500
    )


def test_a_truncated_pair_is_refused_rather_than_compared(tiny_tokenizer):
    """TRL cuts an over-long pair elsewhere than our data code: the bench stops instead of comparing
    different tokens."""
    import datasets

    from onegpu.bench.train_trl import record_rows
    from onegpu.config import DataConfig
    from onegpu.data import batches

    records = datasets.Dataset.from_list(
        [
            {"prompt": "def f(x):\n", "chosen": "    return x\n", "rejected": "x return\n"},
            {
                "prompt": "import os\n" * 20,
                "chosen": "print(os.sep)\n" * 10,
                "rejected": "os print\n" * 10,
            },
        ]
    )
    cfg = DataConfig(seq_len=48, overlong="truncate")
    tokenized, _ = batches.tokenize_counted(records, "preference", tiny_tokenizer, cfg, "train")
    assert record_rows(records, tokenized.select([0]), tiny_tokenizer, cfg) == [0]
    with pytest.raises(ConfigError, match="truncated") as err:
        record_rows(records, tokenized, tiny_tokenizer, cfg)
    assert "seq_len" in err.value.hint
