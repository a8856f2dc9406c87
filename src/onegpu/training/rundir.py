"""The run directory: where a run writes, checked before anything is written (a bad input must
leave no trace), created once every input has been checked, and the settled config saved in it."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
from pathlib import Path

from onegpu.config import Config, save_yaml
from onegpu.errors import ConfigError
from onegpu.training.state import Callback

log = logging.getLogger(__name__)


def check_run_dir(cfg: Config) -> Path:
    """Where the run will write, checked without writing anything (a bad input must leave no
    trace)."""
    out = cfg.output
    name = out.name or time.strftime("%Y%m%d-%H%M%S")
    path = Path(out.dir).expanduser() / name
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"run directory {path} is a file.", hint="choose another --output.name or --output.dir"
        )
    if path.exists() and any(path.iterdir()) and not (out.overwrite or out.resume):
        raise ConfigError(
            f"run directory {path} is not empty.",
            hint="pass --output.resume latest to continue it, --output.overwrite true, or another "
            "--output.name",
        )
    parent = _existing_ancestor(path)
    problem = _unwritable(parent)
    if problem:
        raise ConfigError(
            f"cannot write to run directory {path}: {parent} is not a writable folder ({problem}).",
            hint="choose a writable --output.dir",
        )
    return path


def _unwritable(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None. os.access is not the answer: root passes it
    on a read-only folder, and some mounts (read-only network or FUSE filesystems) grant it and
    then refuse the write. So a file is created and removed at once: nothing is left behind."""
    import errno
    import tempfile

    if not folder.is_dir():
        return "it is a file"
    try:
        fd, probe = tempfile.mkstemp(prefix=".onegpu-write-test-", dir=folder)
    except OSError as exc:
        return (
            "read-only file system"
            if exc.errno == errno.EROFS
            else (exc.strerror or str(exc)).lower()
        )
    os.close(fd)
    os.unlink(probe)
    return None


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def create_run_dir(path: Path, is_main: bool = True) -> None:
    if not is_main:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write to run directory {path}: {exc.strerror}.",
            hint="choose a writable --output.dir",
        ) from None


class FirstStep(Callback):
    """Whether the loop finished an optimizer step (its log record, written before on_step_end,
    counts: the metrics then hold a trained step)."""

    def __init__(self):
        self.done = False

    def on_log(self, run, state, record: dict) -> None:
        self.done = True

    def on_step_end(self, run, state) -> None:
        self.done = True


@contextlib.contextmanager
def removed_if_failed_early(path: Path, is_main: bool, fresh: bool):
    """Around a run from the creation of its directory: if it fails before its first optimizer
    step (a reward function that raises, an out-of-memory error at step 1), what it wrote there (a
    config, an empty or evaluation-only metrics file, tracker files, a reference pass) is removed,
    the directory too when the run created it, so no half-written run is left to be mistaken for
    one that trained or to be resumed. A resumed run, or one that trained a step, keeps it all.
    Yields the callback that tells the first step apart; enter before ``create_run_dir``."""
    before = set(os.listdir(path)) if path.is_dir() else None
    first = FirstStep()
    try:
        yield first
    except BaseException:
        if is_main and fresh and not first.done and path.is_dir():
            _remove_new(path, before)
            log.warning("removed %s: the run failed before its first step", path)
        raise


def _remove_new(path: Path, before: set[str] | None) -> None:
    if before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in set(os.listdir(path)) - before:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


CHECKPOINT_MARGIN = 64 * 2**20  # bytes: config, tokenizer, metrics and filesystem slack


def checkpoint_bytes(model) -> int:
    """A checkpoint's size, estimated generously: weights plus optimizer moments ~ 3x the
    parameters."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + CHECKPOINT_MARGIN


def check_disk(model, run_dir: Path) -> None:
    """Fail before training, not at the first save hours later, when a checkpoint cannot fit."""
    import shutil

    need = checkpoint_bytes(model)
    folder = _existing_ancestor(run_dir)
    free = shutil.disk_usage(folder).free
    if free < need:
        # A read-only filesystem reports no free space: say what is really wrong.
        problem = _unwritable(folder)
        if problem:
            raise ConfigError(
                f"cannot write to run directory {run_dir}: {folder} is not a writable folder "
                f"({problem}).",
                hint="choose a writable --output.dir",
            )
        raise ConfigError(
            f"not enough free disk for checkpoints in {run_dir}: {free / 2**30:.2f} GiB free, "
            f"about {need / 2**30:.2f} GiB needed per checkpoint.",
            hint="free space, or choose another --output.dir",
        )


def save_config(cfg: Config, data_format: str, run_dir: Path) -> None:
    # the detected data format is recorded, as the settled hyper-parameters are: `onegpu generate`
    # reads it to feed a model trained on chat data its prompts as chat turns
    cfg = copy.deepcopy(cfg)
    cfg.data.format = data_format or cfg.data.format
    save_yaml(cfg, run_dir / "config.yaml")
