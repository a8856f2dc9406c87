"""Checkpoints: one directory per step, written under a temporary name and renamed atomically."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

PREFIX = "checkpoint-"


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, train_state: dict, accelerator,
                    tokenizer=None) -> Path:
    """Write ``checkpoint-<step>`` atomically: a crash leaves either the old set or the new one."""
    final = Path(run_dir) / f"{PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(str(tmp / "model"), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "model"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "state.json").write_text(json.dumps(train_state, indent=2))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return final


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never complete)."""
    return sorted(p for p in Path(run_dir).glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "state.json").is_file())


def prune(run_dir: Path, keep_last: int) -> None:
    for p in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
