"""lr, warm-up and weight decay default to auto and are settled by the training mode (hyper.py)."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import yaml

from helpers import CORPUS
from onegpu import train
from onegpu.config import Config, from_dict, load_yaml, validate
from onegpu.errors import ConfigError
from onegpu.hyper import auto_table, describe, resolve_hyperparameters, training_mode
from onegpu.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded

PRETRAINED = "/some/local/model"  # never loaded: the mode is read from the name and the techniques
MODES = {
    "scratch": {},
    "full": {"model": {"name": PRETRAINED}},
    "lora": {"model": {"name": PRETRAINED}, "techniques": {"lora": {"enabled": True}}},
    "qlora": {
        "model": {"name": PRETRAINED},
        "techniques": {"lora": {"enabled": True, "quantize_base": "nf4"}},
    },
}


def settled(data: dict, model_name: str | None = None):
    return resolve_hyperparameters(validate(from_dict(data)), model_name).training


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_takes_its_table_values(mode):
    cfg = validate(from_dict(MODES[mode]))
    assert training_mode(cfg) == mode
    t, row = settled(MODES[mode]), auto_table()[mode]
    assert (t.lr, t.weight_decay, t.warmup_ratio) == (row["lr"], row["weight_decay"], None)
    steps = (
        row["warmup_steps"]
        if row["warmup_ratio"] is None
        else math.ceil(row["warmup_ratio"] * t.max_steps)
    )
    assert t.warmup_steps == steps


@pytest.mark.parametrize("mode", list(MODES))
def test_grpo_takes_its_own_table_in_each_mode(mode):
    from onegpu.hyper import grpo_table

    data = {**MODES[mode], "training": {"objective": "grpo", "micro_batch_size": 16}}
    data["grpo"] = {"rewards": ["length"]}
    t, row = settled(data), grpo_table()[mode]
    assert (t.lr, t.weight_decay) == (row["lr"], row["weight_decay"])
    ratio = row["warmup_ratio"]
    assert t.warmup_steps == (row["warmup_steps"] if ratio is None else math.ceil(ratio * 200))
    assert grpo_table()["full"]["lr"] == 1e-6  # TRL's GRPOConfig default
    assert grpo_table()["lora"]["lr"] == 5e-6  # Unsloth's GRPO notebooks


@pytest.mark.parametrize("mode", list(MODES))
def test_a_reward_model_takes_its_own_table_in_each_mode(mode):
    from onegpu.hyper import reward_table

    data = {**MODES[mode], "training": {"objective": "reward"}}
    t, row = settled(data), reward_table()[mode]
    assert (t.lr, t.weight_decay) == (row["lr"], row["weight_decay"])
    ratio = row["warmup_ratio"]
    assert t.warmup_steps == (row["warmup_steps"] if ratio is None else math.ceil(ratio * 200))
    if mode != "scratch":  # TRL's RewardConfig default, not DPO's 1e-6
        assert (t.lr, t.warmup_steps) == (1e-4, 0)


def test_the_table():
    assert auto_table() == {
        "scratch": {"lr": 2e-3, "warmup_steps": 20, "warmup_ratio": None, "weight_decay": 0.1},
        "full": {"lr": 2e-5, "warmup_steps": None, "warmup_ratio": 0.03, "weight_decay": 0.0},
        "lora": {"lr": 2e-4, "warmup_steps": None, "warmup_ratio": 0.03, "weight_decay": 0.0},
        "qlora": {"lr": 2e-4, "warmup_steps": None, "warmup_ratio": 0.03, "weight_decay": 0.0},
    }
    assert settled(MODES["full"]).warmup_steps == 6  # 3% of the default 200 steps


def test_mode_by_model_name_and_from_scratch():
    assert (
        training_mode(Config(), "tiny") == "scratch"
        and training_mode(Config(), "125m") == "scratch"
    )
    assert (
        training_mode(from_dict({"model": {"name": PRETRAINED, "from_scratch": True}})) == "scratch"
    )
    assert training_mode(Config(), PRETRAINED) == "full"  # the run's resolved model name decides


@pytest.mark.parametrize("mode", list(MODES))
def test_a_value_the_user_sets_is_kept_in_every_mode(mode):
    data = json.loads(json.dumps(MODES[mode]))
    data["training"] = {"lr": 1e-4, "weight_decay": 0.05, "warmup_steps": 7}
    t = settled(data)
    assert (t.lr, t.weight_decay, t.warmup_steps) == (1e-4, 0.05, 7)
    data["training"] = {"lr": 0.0, "warmup_ratio": 0.25}  # zero is a value, not "unset"
    t = settled(data)
    assert (t.lr, t.warmup_steps) == (0.0, 50) and t.weight_decay == auto_table()[mode][
        "weight_decay"
    ]


def test_warmup_ratio_keeps_a_short_run_proportionate():
    assert settled({"model": {"name": PRETRAINED}, "training": {"max_steps": 10}}).warmup_steps == 1
    assert settled({"training": {"max_steps": 40, "warmup_ratio": 0.1}}).warmup_steps == 4
    assert settled({"training": {"max_steps": 7, "warmup_ratio": 0.0}}).warmup_steps == 0
    assert (
        settled({"model": {"name": PRETRAINED}, "training": {"max_steps": 1000}}).warmup_steps == 30
    )


def test_settling_twice_changes_nothing():
    once = resolve_hyperparameters(validate(from_dict(MODES["lora"])))
    assert resolve_hyperparameters(once) == once
    assert "(set)" in describe(once) and "(auto)" not in describe(once)


def test_both_warmups_set_is_a_clear_error(tmp_path):
    data = {"training": {"warmup_steps": 10, "warmup_ratio": 0.1}}
    with pytest.raises(
        ConfigError, match="warmup_steps=10 and training.warmup_ratio=0.1 both set"
    ) as err:
        settled(data)
    assert "keep one of them" in err.value.hint
    with pytest.raises(ConfigError, match="both set"):  # before any run directory exists
        train({**data, "output": {"dir": str(tmp_path), "name": "run"}})
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"warmup_ratio must be in \[0, 1\)"):
        settled({"training": {"warmup_ratio": 1.5}})


def test_settled_values_are_checked_like_any_other():
    with pytest.raises(ConfigError, match="training.lr must not be negative"):
        settled({"training": {"lr": -1.0}})


def test_cli_and_yaml_accept_auto_and_numbers(tmp_path):
    from onegpu.cli.args import make_parser, parse

    def cli(*argv):
        return parse(make_parser("onegpu train", "", Config), list(argv), Config)[0].training

    t = cli()
    assert (t.lr, t.warmup_steps, t.warmup_ratio, t.weight_decay) == ("auto", "auto", None, "auto")
    t = cli("--training.lr", "1e-4", "--training.weight_decay", "0", "--training.warmup_steps", "5")
    assert (t.lr, t.weight_decay, t.warmup_steps) == (1e-4, 0.0, 5) and isinstance(
        t.weight_decay, float
    )
    assert cli("--training.lr", "auto", "--training.warmup_ratio", "0.1").warmup_ratio == 0.1
    with pytest.raises(ConfigError, match="training.lr must be a number, got 'fast'") as err:
        cli("--training.lr", "fast")
    assert "or auto" in err.value.hint
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump({"training": {"lr": "auto", "warmup_ratio": 0.05, "weight_decay": 0}})
    )
    t = cli("--config", str(p))
    assert (t.lr, t.warmup_ratio, t.weight_decay, t.warmup_steps) == ("auto", 0.05, 0.0, "auto")
    assert from_dict({"training": {"lr": 3e-4, "warmup_steps": 4}}).training.lr == 3e-4
    with pytest.raises(ConfigError, match="training.lr must be a number or 'auto', got 'autp'"):
        from_dict({"training": {"lr": "autp"}})
    with pytest.raises(ConfigError, match="training.warmup_steps"):
        from_dict({"training": {"warmup_steps": 2.5}})


def test_the_planners_recommendation_carries_settled_numbers(tiny_model_dir):
    from onegpu.plan import make_plan

    _, rec = make_plan(Config(), "tiny", "T4", 256, 32)
    assert (rec.training.lr, rec.training.warmup_steps, rec.training.weight_decay) == (
        2e-3,
        20,
        0.1,
    )
    _, rec = make_plan(
        from_dict({"techniques": {"lora": {"enabled": True, "r": 8}}}),
        str(tiny_model_dir),
        "T4",
        64,
        8,
    )
    assert (rec.training.lr, rec.training.warmup_steps, rec.training.weight_decay) == (2e-4, 6, 0.0)
    assert rec.training.warmup_ratio is None


def test_the_benchmarks_base_config_has_numbers():
    from onegpu.bench.settings import BenchTrainConfig
    from onegpu.bench.train import base_config

    t = base_config(BenchTrainConfig(), "/tmp/x")["training"]
    assert (t["lr"], t["warmup_steps"], t["weight_decay"]) == (2e-3, 0, 0.1)


def losses(run_dir) -> list[tuple]:
    return [(r["split"], r["step"], r.get("loss")) for r in read_metrics(run_dir / "metrics.jsonl")]


SHORT = {
    "data": {"max_bytes": 200_000, "seq_len": 64, "num_proc": 1},
    "training": {
        "micro_batch_size": 4,
        "max_steps": 24,
        "eval_every": 12,
        "eval_batches": 2,
        "log_every": 4,
    },
    "output": {"report_to": "none"},
}


def test_the_default_job_trains_exactly_as_before(tmp_path, caplog):
    """A preset from scratch: auto must be today's numbers, bit for bit (warm-up 20 of 24 steps)."""

    def run(name, **training):
        cfg = json.loads(json.dumps(SHORT))
        cfg["training"].update(training)
        cfg["output"].update(dir=str(tmp_path), name=name)
        return train(cfg).run_dir

    with caplog.at_level(logging.INFO, logger="onegpu.training.run"):
        auto = run("auto")
    assert (
        "hyper-parameters (training from scratch): lr 2e-3 (auto), warm-up 20 steps (auto), "
        "weight decay 0.1 (auto)" in caplog.text
    )
    explicit = run("explicit", lr=2e-3, warmup_steps=20, weight_decay=0.1)
    assert losses(auto) == losses(explicit) and len(losses(auto)) >= 6
    saved = load_yaml(auto / "config.yaml")["training"]
    assert (saved["lr"], saved["warmup_steps"], saved["warmup_ratio"], saved["weight_decay"]) == (
        2e-3,
        20,
        None,
        0.1,
    )


def test_a_fine_tune_saves_settled_numbers_and_resumes_from_its_config(
    tmp_path, tiny_model_dir, caplog
):
    """The run's config.yaml records the settled numbers (not auto); `--config <run>/config.yaml
    --output.resume latest` continues with exactly them."""
    from onegpu.checkpoint import local as checkpoint
    from onegpu.cli.main import main

    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": CORPUS[i % len(CORPUS)] * 2}) + "\n" for i in range(60))
    )
    cfg = {
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(data), "seq_len": 32, "num_proc": 1},
        "training": {
            "micro_batch_size": 2,
            "max_steps": 40,
            "eval_every": 0,
            "log_every": 1,
            "save_every": 20,
        },
        "output": {
            "dir": str(tmp_path / "runs"),
            "name": "run",
            "report_to": "none",
            "keep_last": 10,
        },
    }
    with caplog.at_level(logging.INFO, logger="onegpu.training.run"):
        run_dir = train(cfg).run_dir
    assert (
        "(full fine-tune of a pretrained model): lr 2e-5 (auto), warm-up 3% = 2 steps (auto)"
        in caplog.text
    )
    saved = load_yaml(run_dir / "config.yaml")["training"]
    assert (saved["lr"], saved["warmup_steps"], saved["warmup_ratio"], saved["weight_decay"]) == (
        2e-5,
        2,
        None,
        0.0,
    )
    expected = losses(run_dir)
    for p in checkpoint.list_checkpoints(run_dir):  # back to step 20, as if stopped there
        if checkpoint.step_of(p) > 20:
            shutil.rmtree(p)
    assert (
        main(["train", "--config", str(run_dir / "config.yaml"), "--output.resume", "latest"]) == 0
    )
    assert losses(run_dir) == expected
    assert load_yaml(run_dir / "config.yaml")["training"] == saved
