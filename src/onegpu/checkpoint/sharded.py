"""Checkpoints of sharded engines (FSDP2, DeepSpeed): the same layout as one process.

FSDP2 states are gathered into full tensors, the optimizer state renumbered like torch's own
state_dict(): such a checkpoint resumes on any number of processes, one included. DeepSpeed keeps
its own per-process files in ``engine/`` (its optimizer partitions, which load only on the process
count that wrote them), next to full weights in ``model/`` (a new run can start from those on any
count). All functions here are collectives: call them on every process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from onegpu.checkpoint.local import ENGINE_DIR, load_trainer_state
from onegpu.errors import ConfigError

ENGINE_TAG = "zero"


def gather_sharded(run_dir: Path, step: int, model, optimizer, accelerator) -> dict:
    """Collect what every process must contribute to a checkpoint. Call on all processes."""
    from onegpu.distributed import full_state_dict, is_deepspeed

    gathered = {"model": full_state_dict(accelerator, model)}  # full weights, on the main process
    if is_deepspeed(accelerator):
        staging = Path(run_dir) / f".engine-{step:08d}"
        if accelerator.is_main_process and staging.exists():
            shutil.rmtree(staging)
        accelerator.wait_for_everyone()
        model.save_checkpoint(str(staging), tag=ENGINE_TAG, save_latest=False)
        gathered.update(engine_dir=staging, optimizer={"engine": "deepspeed"})
    else:
        gathered["optimizer"] = _full_optimizer_state(model, optimizer)
    return gathered


def _full_optimizer_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(
        model, _inner(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not full:  # only the main process receives the gathered tensors
        return {}
    index = {name: i for i, name in enumerate(n for g in full["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper -> the torch optimizer


def load_sharded(path: Path, model, optimizer, scheduler, accelerator) -> dict:
    """Restore a checkpoint into FSDP2- or DeepSpeed-sharded model and optimizer (all processes)."""
    from onegpu.distributed import is_deepspeed

    path = Path(path)
    blob = load_trainer_state(path)
    if is_deepspeed(accelerator):
        _load_engine(path, model)
    else:
        if blob["optimizer"].get("engine") == "deepspeed":
            raise ConfigError(
                f"checkpoint {path} holds DeepSpeed optimizer partitions; this run uses FSDP2.",
                hint="resume with the same techniques.offload / distributed.strategy it was "
                "written with",
            )
        _load_fsdp2(path, model, optimizer, blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    state = json.loads((path / "state.json").read_text())
    state["rng"] = blob["rng"]
    return state


def _load_engine(path: Path, model) -> None:
    if not (path / ENGINE_DIR).is_dir():
        raise ConfigError(
            f"checkpoint {path} was not written by DeepSpeed, so it has no optimizer partitions.",
            hint="resume it without techniques.offload / distributed.strategy=deepspeed",
        )
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    try:
        loaded, _ = model.load_checkpoint(
            str(path / ENGINE_DIR), tag=ENGINE_TAG, load_lr_scheduler_states=False
        )
    except (AssertionError, RuntimeError, ValueError, ZeRORuntimeException) as exc:
        raise ConfigError(
            f"DeepSpeed cannot load {path}: {str(exc).splitlines()[0]}",
            hint="resume with the number of processes that wrote it (DeepSpeed cannot re-partition "
            f"optimizer state), or start a new run from its weights: --model.name {path}/model",
        ) from None
    if loaded is None:
        raise ConfigError(
            f"DeepSpeed found no checkpoint in {path / ENGINE_DIR}.",
            hint="resume from another checkpoint",
        )


def _load_fsdp2(path: Path, model, optimizer, optim_state: dict) -> None:
    """Full tensors from disk -> this process's shards (DCP re-shards for any process count)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights: dict[str, Any] = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=opts)
    names = {id(p): n for n, p in model.named_parameters()}
    inner = _inner(optimizer)
    fqns = [names[id(p)] for g in inner.param_groups for p in g["params"]]
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in optim_state["param_groups"]]
    full = {
        "state": {fqns[int(i)]: s for i, s in optim_state["state"].items()},
        "param_groups": groups,
    }
    set_optimizer_state_dict(model, inner, full, options=opts)
