"""The export's output folder: written under a temporary name beside it and renamed when whole, so
an interrupted export never leaves a folder that looks finished; an existing one is replaced only
with --force; a full disk is refused before writing when the sizes say so, and one clear error
(the partial folder removed) when the disk fills during the writing."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from onegpu.checkpoint.manifest import fsync_dir, fsync_tree
from onegpu.errors import ConfigError, OnegpuError

PARTIAL = ".partial-"  # a folder whose name holds this is never a finished export


class DiskFullError(OnegpuError):
    """The output's disk has not enough room."""


def check_target(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise ConfigError(
            f"output folder '{out}' already exists.",
            hint="pass --force to replace it, or choose another --output",
        )


def check_room(out: Path, need_bytes: int) -> None:
    """Refuse before writing anything when the output's file system has less room than the export
    takes (``need_bytes``, from the plan)."""
    parent = _existing_parent(out)
    free = free_bytes(out)
    if free < need_bytes:
        raise DiskFullError(
            f"the export needs about {_mib(need_bytes)} on {parent}, which has {_mib(free)} free.",
            hint="free some space or choose an --output on another disk",
        )


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out`` (an old ``out``,
    allowed by ``force``, is removed only then). On any failure it is removed: nothing
    half-written is left."""
    check_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}{PARTIAL}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(
                f"the disk of '{out.parent}' filled up while writing the export ({exc}); "
                "nothing was kept.",
                hint="free some space or choose an --output on another disk",
            ) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)  # on disk before its name is final, as a checkpoint's is
    if out.exists():
        old = out.with_name(f"{out.name}{PARTIAL}old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def free_bytes(out: Path) -> int:
    """Free bytes on the file system the output will be written to."""
    return shutil.disk_usage(_existing_parent(out)).free


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.0f} KiB"
