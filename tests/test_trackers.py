"""Experiment trackers (output.report_to): every tracker gets the names, values and steps of
metrics.jsonl and the config once; resume continues the same tracker runs; a tracker not installed
is refused before the run."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import sys

import pytest

from helpers import CORPUS
from onegpu import train
from onegpu.config import from_dict
from onegpu.errors import ConfigError
from onegpu.report import read_metrics

HAS_TRACKIO = importlib.util.find_spec("trackio") is not None


def _cfg(tmp_path, model_dir, report_to, **training):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text(
            "".join(json.dumps({"text": CORPUS[i % len(CORPUS)] * 2}) + "\n" for i in range(60))
        )
    t = dict(
        micro_batch_size=2,
        max_steps=6,
        eval_every=3,
        eval_batches=2,
        log_every=2,
        warmup_steps=2,
        save_every=3,
        lr=1e-2,
        seed=7,
    )
    t.update(training)
    return {
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "seq_len": 32, "num_proc": 1, "val_fraction": 0.1},
        "training": t,
        "output": {"dir": str(tmp_path / "runs"), "name": "run", "report_to": report_to},
    }


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    """W&B offline and MLflow/Trackio stores, all inside tmp_path: nothing leaves the machine."""
    pytest.importorskip("wandb")  # both in the test extras
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in (
        "WANDB_CACHE_DIR",
        "WANDB_CONFIG_DIR",
        "WANDB_DATA_DIR",
    ):  # not the user's ~/.cache, ~/.config
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # MLflow 3 keeps the file store behind this switch
    monkeypatch.setenv("ONEGPU_PROJECT", "onegpu-tests")
    for var in ("WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "wandb").mkdir()
    # Trackio reads TRACKIO_DIR once, at import: set it, and move it in modules already imported
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for name, mod in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(mod, "TRACKIO_DIR"):
            monkeypatch.setattr(mod, "TRACKIO_DIR", tmp_path / "trackio")
    return tmp_path


def expected_points(run_dir) -> dict[str, dict[int, float]]:
    """metrics.jsonl as the trackers should show it: <split>/<field> -> {step: value}."""
    out: dict[str, dict[int, float]] = {}
    for rec in read_metrics(run_dir / "metrics.jsonl"):
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("step", "split"):
                out.setdefault(f"{rec['split']}/{k}", {})[rec["step"]] = v
    return out


def wandb_records(wandb_dir):
    """The protobuf records of W&B offline run files (the LevelDB-style log W&B writes: a 7-byte
    file header, 32 KiB blocks, each chunk with a 7-byte header: crc32, length, type
    FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    for path in sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        pos, chunks = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
                pos += left
                continue
            chunks += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                rec = pb.Record()
                rec.ParseFromString(chunks)
                chunks = b""
                yield rec


def wandb_points(records) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            for k, v in items.items():
                if not k.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    out.setdefault(k, {})[items["_step"]] = v
    return out


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return MlflowClient(), MlflowClient().get_run(run_id)


def test_every_tracker_gets_the_metrics_of_metrics_jsonl_and_the_config_once(
    tracker_env, tiny_model_dir
):
    from onegpu.config import load_yaml
    from onegpu.trackers import flat_config

    report_to = "tensorboard,wandb,mlflow" + (",trackio" if HAS_TRACKIO else "")
    run_dir = train(_cfg(tracker_env, tiny_model_dir, report_to)).run_dir
    expected = expected_points(run_dir)
    assert {"train/loss", "train/lr", "val/loss", "val/perplexity"} <= expected.keys()
    assert sorted(expected["train/loss"]) == [2, 4, 6] and sorted(expected["val/loss"]) == [0, 3, 6]
    params = flat_config(load_yaml(run_dir / "config.yaml"))
    assert params["output.report_to"] == report_to and params["training.max_steps"] == 6

    records = list(wandb_records(tracker_env / "wandb"))
    assert wandb_points(records) == expected
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [(r.display_name, r.project) for r in runs] == [("run", "onegpu-tests")]
    updates = [
        {i.key: json.loads(i.value_json) for i in r.config.update}
        for r in records
        if r.WhichOneof("record_type") == "config"
    ]
    assert [u for u in updates if "training.lr" in u] == [
        {k: v for k, v in params.items()}
    ]  # once, all of it

    client, run = mlflow_run(run_dir)
    got = {
        k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
        for k in run.data.metrics
    }
    assert got == expected
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "onegpu-tests"
    assert run.data.params == {k: str(v) for k, v in params.items()}

    hparams = glob.glob(str(run_dir / "tensorboard" / "*" / "hparams.yml"))
    assert len(hparams) == 1
    tensorboard = _tensorboard_points(run_dir / "tensorboard")  # TensorBoard keeps float32
    assert tensorboard.keys() == expected.keys()
    assert all(tensorboard[k] == pytest.approx(expected[k], rel=1e-6) for k in expected)

    if HAS_TRACKIO:
        from trackio.sqlite_storage import SQLiteStorage

        logs = SQLiteStorage.get_logs("onegpu-tests", "run")
        trackio = {}
        for row in logs:
            for k, v in row.items():
                if "/" in k:
                    trackio.setdefault(k, {})[row["step"]] = v
        assert trackio == expected
        config = SQLiteStorage.get_run_config("onegpu-tests", "run")
        assert {k: config[k] for k in params} == params


def _tensorboard_points(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_resume_continues_the_same_tracker_runs(tracker_env, tiny_model_dir):
    """The redone steps after a resume land in the W&B and MLflow runs of the first start (their ids
    are kept in trackers.json); the config is not logged again (MLflow would refuse a changed
    parameter)."""
    cfg = _cfg(tracker_env, tiny_model_dir, "wandb,mlflow")
    run_dir = train(cfg).run_dir
    first = json.loads((run_dir / "trackers.json").read_text())
    cfg["output"]["resume"] = str(run_dir / "checkpoint-00000003")
    cfg["training"]["max_steps"] = 8  # the resumed run goes further: steps 4-6 redone, 7-8 new
    train(cfg)
    assert json.loads((run_dir / "trackers.json").read_text()) == first
    expected = expected_points(run_dir)
    assert sorted(expected["train/loss"]) == [2, 4, 6, 8]

    client, run = mlflow_run(run_dir)
    latest = {}
    for k in run.data.metrics:
        for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.timestamp):
            latest.setdefault(k, {})[m.step] = m.value
    assert latest == expected and run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "6"  # as first logged

    records = list(wandb_records(tracker_env / "wandb"))
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {
        first["wandb"]
    }
    assert wandb_points(records)["train/loss"][8] == expected["train/loss"][8]


def test_an_error_mid_run_closes_the_trackers_marked_failed(tracker_env, tiny_model_dir):
    import mlflow

    from onegpu.training.state import Callback

    class Crash(Callback):
        def on_log(self, run, state, record):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(_cfg(tracker_env, tiny_model_dir, "wandb,mlflow", save_every=0), callbacks=[Crash()])
    run_dir = tracker_env / "runs" / "run"
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FAILED" and mlflow.active_run() is None
    exits = [
        r.exit
        for r in wandb_records(tracker_env / "wandb")
        if r.WhichOneof("record_type") == "exit"
    ]
    assert [e.exit_code for e in exits] == [1]


def test_a_tracker_not_installed_is_refused_before_the_run_dir(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setitem(
        sys.modules, "wandb", None
    )  # makes `import wandb` fail as if it were absent
    with pytest.raises(
        ConfigError, match=r"wandb package is not installed(.|\n)*pip install wandb"
    ):
        train(_cfg(tmp_path, tiny_model_dir, "tensorboard,wandb"))
    assert not (tmp_path / "runs" / "run").exists()


def test_report_to_none_writes_no_tensorboard_folder(tmp_path, tiny_model_dir):
    r = train(_cfg(tmp_path, tiny_model_dir, "none", max_steps=2, eval_every=0, save_every=0))
    assert read_metrics(r.run_dir / "metrics.jsonl")
    assert not (r.run_dir / "tensorboard").exists() and not (r.run_dir / "trackers.json").exists()


@pytest.mark.parametrize(
    "output, report_to",
    [
        ({}, "tensorboard"),
        ({"tensorboard": True}, "tensorboard"),  # what every config.yaml before report_to holds
        ({"tensorboard": False}, "none"),
        ({"tensorboard": False, "report_to": "tensorboard,wandb"}, "wandb"),
        ({"tensorboard": True, "report_to": "mlflow"}, "tensorboard,mlflow"),
        ({"report_to": " WandB, mlflow,wandb "}, "wandb,mlflow"),
        ({"report_to": "all"}, "all"),
    ],
)
def test_old_tensorboard_switch_is_folded_into_report_to(output, report_to):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = from_dict({"output": output}).output
    assert (out.report_to, out.tensorboard) == (report_to, None)
    deprecated = [w for w in caught if "output.tensorboard is deprecated" in str(w.message)]
    assert len(deprecated) == ("tensorboard" in output)  # the old switch, and only it, warns
    assert all(w.category is FutureWarning for w in deprecated)


@pytest.mark.parametrize(
    "value, match",
    [
        ("wandbb", "unknown tracker 'wandbb'"),
        ("all,wandb", "stand alone"),
    ],
)
def test_bad_report_to_names_the_field(value, match):
    with pytest.raises(ConfigError, match=match) as err:
        from_dict({"output": {"report_to": value}})
    assert "output.report_to" in str(err.value)


def test_bad_report_to_on_the_command_line_is_one_clear_error():
    from onegpu.cli.args import make_parser, parse
    from onegpu.config import Config

    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        parse(make_parser("onegpu train", "", Config), ["--output.report_to", "tensorbord"], Config)


def test_benchmarks_report_to_no_tracker(tmp_path, tiny_model_dir, text_file):
    """An arm's run, from the config every benchmark arm starts from (bench.train.base_config),
    writes its metrics and no tracker's files: no TensorBoard folder, no trackers.json."""
    from onegpu.bench.settings import BenchTrainConfig
    from onegpu.bench.train import base_config
    from onegpu.bench.train_child import run_onegpu

    b = BenchTrainConfig()
    b.model.name, b.model.from_scratch = str(tiny_model_dir), False
    b.data.path, b.data.seq_len = str(text_file), 32
    b.training.micro_batch_size, b.training.max_steps, b.bench.warmup_steps = 2, 2, 1
    cfg = base_config(b, str(tmp_path / "arm"))
    out = run_onegpu({"config": cfg, "warmup_steps": 1})
    (run_dir,) = (tmp_path / "arm").iterdir()
    assert out["steps_done"] == 2 and read_metrics(run_dir / "metrics.jsonl")
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "trackers.json").exists()


def test_all_means_the_installed_trackers(monkeypatch):
    from onegpu import trackers

    monkeypatch.setattr(
        trackers, "_installed", lambda module: module in ("tensorboard", "wandb", "mlflow")
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
    assert trackers.resolve("all") == ["tensorboard", "wandb", "mlflow"]
    assert trackers.resolve("none") == []
