"""`onegpu bench train --objective kto|reward`: onegpu's KTO and reward model next to TRL's
KTOTrainer and RewardTrainer on the same records, each arm trained for real."""

from __future__ import annotations

import json

import pytest

from onegpu.bench import train as bench_train
from onegpu.errors import ConfigError
from test_bench_dpo import dpo_bench


def _listed(capsys, objective: str, tmp_path) -> dict:
    from onegpu.cli.main import main

    argv = ["bench", "train", "--objective", objective, "--bench.dry_run", "true"]
    assert main(argv + ["--bench.out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"objective {objective}" in out and not any(tmp_path.iterdir())
    return {
        line.split()[0]: line.split(None, 1)[1]
        for line in out.splitlines()
        if line.startswith("  ")
    }


@pytest.mark.parametrize(
    "objective, trainer", [("kto", "TRL KTOTrainer"), ("reward", "TRL RewardTrainer")]
)
def test_dry_run_lists_the_arms_with_trls_trainer(capsys, tmp_path, objective, trainer):
    listed = _listed(capsys, objective, tmp_path)
    peer = f"trl-{objective}"
    ours = (
        ["baseline", "lora"] + (["two-rows"] if objective == "reward" else []) + ["checkpointing"]
    )
    assert list(listed) == ours + [peer, f"{peer}-lora"]
    assert listed[peer] == trainer and listed["lora"] == "techniques.lora.enabled=True"
    assert listed["checkpointing"] == "techniques.checkpointing=full"
    if objective == "reward":
        assert listed["two-rows"] == "techniques.shared_prompt=off"
    assert listed[f"{peer}-lora"] == f"{trainer} (techniques.lora.enabled=True)"


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["kto", "reward"])
def test_our_arm_and_trls_train_on_the_same_tokens_and_report_speed_and_memory(tmp_path, objective):
    """Real children, 2 steps each: both arms count the same real tokens (TRL tokenized the same
    records into the same ids), write tokens/s and memory and the ratio to TRL; KTO's precomputed
    reference is reported apart; the reward models start from the same weights on the same pairs,
    so their losses agree."""
    peer = f"trl-{objective}"
    b = dpo_bench(tmp_path, training__objective=objective, bench__arms=f"baseline,{peer}")
    paths = bench_train.run(b)
    doc = json.loads(paths["json"].read_text())
    arms = doc["arms"]
    assert doc["setup"]["data_format"] == ("unpaired" if objective == "kto" else "preference")
    for name in ("baseline", peer):
        (r,) = arms[name]["reps"]
        assert arms[name]["status"] == "ok", (name, arms[name].get("reason"))
        assert r["steps_done"] == 2 and r["timed_steps"] == 1, name
        assert r["tokens_per_s"] > 0 and r["train_mem_mb"] > 0, name
        assert r["timed_tokens"] == arms["baseline"]["reps"][0]["timed_tokens"] > 0, name
    ev = arms[peer]["reps"][0]["evidence"]
    assert ev["same_tokens"] is True and ev["checkpointing"] is True and ev["precision"] == "fp32"
    assert set(doc[f"vs_trl_{objective}"]) == {"baseline"}
    md = paths["md"].read_text()
    assert f"vs TRL {'KTOTrainer' if objective == 'kto' else 'RewardTrainer'} (defaults)" in md
    if objective == "kto":
        assert ev["reference"].startswith("frozen copy")
        assert arms["baseline"]["reps"][0]["reference_pass"]["seconds"] > 0
        assert "with its reference pass" in md
    else:
        assert ev["score_head"] == "LlamaForSequenceClassification"
        assert arms[peer]["final_loss"] == pytest.approx(arms["baseline"]["final_loss"], rel=1e-3)


def test_a_truncated_kto_example_is_refused_rather_than_compared(tiny_tokenizer):
    """TRL cuts an over-long example elsewhere than our data code: the bench stops instead of
    comparing different tokens."""
    import datasets

    from onegpu.bench.train_trl import record_rows
    from onegpu.config import DataConfig
    from onegpu.data import batches

    records = datasets.Dataset.from_list(
        [
            {"prompt": "def f(x):\n", "completion": "    return x\n", "label": True},
            {"prompt": "import os\n" * 20, "completion": "print(os.sep)\n" * 10, "label": False},
        ]
    )
    cfg = DataConfig(seq_len=48, overlong="truncate")
    tokenized, _ = batches.tokenize_counted(records, "unpaired", tiny_tokenizer, cfg, "train")
    assert record_rows(records, tokenized.select([0]), tiny_tokenizer, cfg, unpaired=True) == [0]
    with pytest.raises(ConfigError, match="truncated") as err:
        record_rows(records, tokenized, tiny_tokenizer, cfg, unpaired=True)
    assert "seq_len" in err.value.hint


def test_the_cpu_presets_run_our_default_beside_trls_one_thread_an_arm(tmp_path):
    """bench_train.py's cpu-kto / cpu-reward presets (and their -small shape): the objective, the
    baseline and TRL's arm, results named by preset, OMP_NUM_THREADS=1 for the sweep and its arms
    (a child inherits it)."""
    from helpers import benchmark_script

    script = benchmark_script("bench_train")
    for objective in ("kto", "reward"):
        for suffix, model in (("", "tiny"), ("-small", "small")):
            preset = script.PRESETS[f"cpu-{objective}{suffix}"]
            argv = script.preset_argv(preset, tmp_path, "20990101", dry_run=True)
            assert argv[argv.index("--training.objective") + 1] == objective
            assert argv[argv.index("--model.name") + 1] == model
            assert argv[argv.index("--bench.arms") + 1] == f"baseline,trl-{objective}"
            assert argv[argv.index("--bench.name") + 1] == f"train-cpu-{objective}{suffix}-20990101"
            assert preset.threads == 1 and not preset.gpu
