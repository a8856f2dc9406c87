"""A checkpoint's manifest: the size and sha256 of every file, written last, so that a folder that
lost or damaged a file afterwards (a full disk, a partial copy) is told apart from a complete one;
and the fsyncs that make the folder durable before it is renamed into place."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, step: int) -> None:
    files = {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(root)
    }
    (root / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def verify(path: Path, checksums: bool = True) -> str | None:
    """None if every file listed in the manifest is present with its size and checksum, else why
    not. Without checksums it is cheap enough for every prune; resuming checks them."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "missing or unreadable manifest.json"
    for name in ("state.json", "trainer_state.pt"):
        if name not in files:
            return f"manifest lists no {name}"
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != meta["size"]:
            return f"size mismatch in {name}"
        if checksums and _sha256(f) != meta["sha256"]:
            return f"checksum mismatch in {name}"
    return None
