"""Experiment trackers (output.report_to): TensorBoard, Weights & Biases, MLflow and Trackio through
Accelerate's tracker classes, fed the very records metrics.jsonl gets.

The tracker classes are built here, on the main process only, rather than through
``Accelerator(log_with=...)`` + ``init_trackers``: the Accelerator is made before the run directory
and the resume step are known, ``init_trackers`` starts W&B and Trackio on every process (their
``main_process_only`` is False), ``end_training`` would also tear down the process group mid-run,
and the jsonl line and the tracker points must come from one ``write`` so that their names and steps
cannot drift.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from onegpu.config import load_yaml, redact, to_dict
from onegpu.config.sections import TRACKERS
from onegpu.errors import ConfigError

log = logging.getLogger(__name__)

# tracker -> (module it imports, what to pip install)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
# W&B and MLflow have their own variable for the project; either wins over ONEGPU_PROJECT.
PROJECT_VARS = {"wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}
IDS_FILE = "trackers.json"  # the W&B/MLflow run ids, so a resume continues the same tracker runs


def resolve(report_to: str) -> list[str]:
    """The trackers output.report_to names, "all" read as the installed ones; a named tracker that
    is not installed raises one ConfigError with the install command (checked before the run
    directory is made)."""
    if report_to == "none":
        return []
    names = (
        [n for n in TRACKERS if _installed(PACKAGES[n][0])]
        if report_to == "all"
        else report_to.split(",")
    )
    for name in names:
        module, package = PACKAGES[name]
        if not _installed(module):
            raise ConfigError(
                f"output.report_to names {name}, but the {package} package is not installed.",
                hint=f"pip install {package}, or leave {name} out of output.report_to",
            )
    if "mlflow" in names:
        _check_mlflow_store()
    return names


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module object without a spec
        return False


def _check_mlflow_store() -> None:
    """MLflow 3 keeps runs in ./mlflow.db when MLFLOW_TRACKING_URI is unset; a database store needs
    SQLAlchemy, which mlflow-skinny lacks. Say so now instead of failing in the first step of the
    run."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    database = uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")
    if (database or not uri) and not _installed("sqlalchemy"):
        where = uri or "MLflow's default store (./mlflow.db)"
        raise ConfigError(
            f"output.report_to=mlflow: {where} is a database, which needs the full mlflow package.",
            hint="set MLFLOW_TRACKING_URI to your server (http://host:5000), or pip install mlflow",
        )


class Trackers:
    """The started trackers of one run. Built on the main process only; the config goes to a tracker
    run once, when that run is new (a continued one already has it, and MLflow refuses to change a
    logged parameter)."""

    def __init__(
        self, names: list[str], run_dir: Path, config: Any = None, purge_step: int | None = None
    ):
        self.trackers: list = []
        run_dir = Path(run_dir)
        resuming = purge_step is not None
        saved = _load_ids(run_dir) if resuming else {}
        if (
            not resuming
        ):  # a new run in a used directory (overwrite) must not continue the old tracker runs
            (run_dir / IDS_FILE).unlink(missing_ok=True)
        # by default the config exactly as config.yaml records it (settled values, detected data
        # format)
        params = flat_config(config if config is not None else _saved_config(run_dir))
        try:
            for name in names:
                tracker = _make(name, run_dir, saved.get(name), purge_step)
                tracker.start()
                self.trackers.append(tracker)
                if not (resuming and _continues(name, saved)):
                    tracker.store_init_configuration(params)
        except BaseException:
            self.finish(failed=True)
            raise
        _save_ids(run_dir, {**saved, **_run_ids(self.trackers)})

    def log(self, record: dict) -> None:
        """The numeric, finite fields of a metrics.jsonl record as ``<split>/<field>`` at its
        step."""
        if "step" not in record:
            return
        prefix = record.get("split", "train")
        values = {
            f"{prefix}/{k}": v
            for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step", "split") and math.isfinite(v)
        }
        if values:
            for tracker in self.trackers:
                tracker.log(values, step=record["step"])

    def finish(self, failed: bool = False) -> None:
        """Close every tracker, marking the tracker run failed where the tracker can; one that fails
        to close is logged, not raised, so the others still close and an error that ended the run is
        not hidden."""
        for tracker in self.trackers:
            try:
                # W&B and MLflow are closed directly: Accelerate's finish() cannot mark a run failed
                if tracker.name == "wandb":
                    tracker.run.finish(exit_code=int(failed))
                elif tracker.name == "mlflow":
                    import mlflow

                    mlflow.end_run(status="FAILED" if failed else "FINISHED")
                else:
                    tracker.finish()
            except Exception as exc:  # see the docstring
                log.warning("could not close the %s tracker: %s", tracker.name, exc)
        self.trackers = []


def _make(name: str, run_dir: Path, run_id: str | None, purge_step: int | None):
    from accelerate import tracking

    project = (
        os.environ.get(PROJECT_VARS.get(name, ""), "")
        or os.environ.get("ONEGPU_PROJECT", "")
        or "onegpu"
    )
    if name == "tensorboard":  # events in run_dir/tensorboard, as before trackers could be chosen
        # purge_step: after a resume, TensorBoard hides the events of the steps being redone
        return tracking.TensorBoardTracker("tensorboard", run_dir, purge_step=purge_step)
    if name == "wandb":  # files beside the run's own unless WANDB_DIR says otherwise
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        return tracking.WandBTracker(
            project, name=run_dir.name, dir=os.environ.get("WANDB_DIR", str(run_dir)), **resume
        )
    if name == "mlflow":
        return tracking.MLflowTracker(experiment_name=project, run_name=run_dir.name, run_id=run_id)
    if name == "trackio":  # Trackio continues a run by its name
        return tracking.TrackioTracker(
            project, name=run_dir.name, resume="allow" if purge_step is not None else "never"
        )
    raise AssertionError(
        f"unknown tracker {name}"
    )  # output.report_to is checked when the config is read


def _continues(name: str, saved: dict[str, str]) -> bool:
    """On a resume: whether the tracker writes on into the run of the first start. TensorBoard's
    folder and Trackio's run name are the run directory's; W&B and MLflow need the id saved then."""
    return name in ("tensorboard", "trackio") or name in saved


def _run_ids(trackers: list) -> dict[str, str]:
    ids = {}
    for tracker in trackers:
        if tracker.name == "wandb":
            ids["wandb"] = tracker.run.id
        elif tracker.name == "mlflow":
            ids["mlflow"] = tracker.active_run.info.run_id
    return ids


def _load_ids(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / IDS_FILE).read_text(encoding="utf-8"))
    except (
        OSError,
        ValueError,
    ):  # none saved (a run from before trackers), or cut short: new tracker runs
        return {}


def _save_ids(run_dir: Path, ids: dict[str, str]) -> None:
    if ids:
        (run_dir / IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")


def _saved_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return load_yaml(path) if path.is_file() else {}


def flat_config(config: Any) -> dict[str, Any]:
    """The run config, tokens redacted, as one level of ``section.field`` keys with plain values:
    the shape every tracker's hyper-parameter table takes (TensorBoard's hparams accept no lists or
    nesting)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = (
                value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
            )

    walk("", redact(config if isinstance(config, dict) else to_dict(config)))
    return out
