"""Checkpoints: one directory per optimizer step that is either complete or absent.

``checkpoint-<step>/`` holds
  model/            ``save_pretrained`` output (safetensors; adapters only for a PEFT model) +
                    tokenizer
  trainer_state.pt  optimizer, scheduler, grad scaler and RNG states, stored as tensors and plain
                    containers only, so ``torch.load(weights_only=True)`` reads it (no arbitrary
                    pickles)
  state.json        the loop's TrainState: step, data position, tokens seen, eval history
  config.yaml       the resolved run configuration (secrets redacted)
  manifest.json     size and sha256 of every file above; written last

Everything is written into a hidden temporary folder, fsynced and then renamed in one step, so a
crash (even kill -9) leaves either the previous set of checkpoints or the new one. Loading checks
the manifest, so a checkpoint damaged afterwards (disk full, a partial copy) is skipped, never used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onegpu.checkpoint.manifest import MANIFEST, fsync_dir, fsync_tree, verify, write_manifest
from onegpu.errors import ConfigError
from onegpu.models import save_tokenizer

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
ENGINE_DIR = "engine"  # DeepSpeed's own per-process files (see checkpoint_sharded.py)
# Called with the name of each write of a checkpoint just completed, in order: SAVE_POINTS.
# The crash tests stop the process at each of them; a caller may also report progress with it.
WriteHook = Callable[[str], None]
SAVE_POINTS = (
    "model",
    "tokenizer",
    "trainer_state",
    "state",
    "config",
    "manifest",
    "fsync",
    "trash",
    "rename",
)


# ------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """All RNG states as tensors/ints/lists: safe for torch.load(weights_only=True)."""
    import numpy as np

    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["name"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------- saving
def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    train_state: dict,
    accelerator,
    tokenizer=None,
    config: dict | None = None,
    rng: dict | None = None,
    gathered: dict | None = None,
    on_write: WriteHook | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically and return its path.

    ``rng`` is the RNG state to store (default: now); the loop passes the state at the start of an
    abandoned accumulation cycle so that the resumed run replays that cycle exactly.
    ``gathered`` comes from ``gather_sharded`` when FSDP2/DeepSpeed split the states across
    processes. ``on_write`` is called after each write (SAVE_POINTS; "trash" only when the step is
    saved again).
    """
    written: WriteHook = on_write or (lambda point: None)
    gathered = gathered or {}
    run_dir = Path(run_dir)
    final = run_dir / f"{PREFIX}{step:08d}"
    tmp = run_dir / f"{TMP_PREFIX}{final.name}"
    clean_stale(run_dir)
    tmp.mkdir(parents=True)
    accelerator.unwrap_model(model).save_pretrained(
        str(tmp / "model"), safe_serialization=True, state_dict=gathered.get("model")
    )
    written("model")
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp / "model")
        written("tokenizer")
    if gathered.get("engine_dir") is not None:
        os.replace(gathered["engine_dir"], tmp / ENGINE_DIR)
    optim_state = gathered["optimizer"] if "optimizer" in gathered else optimizer.state_dict()
    torch.save(
        {
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            "rng": rng if rng is not None else rng_state(),
        },
        tmp / "trainer_state.pt",
    )
    written("trainer_state")
    (tmp / "state.json").write_text(json.dumps(train_state, indent=2))
    written("state")
    if config is not None:
        import yaml

        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        written("config")
    write_manifest(tmp, step)
    written("manifest")
    fsync_tree(tmp)
    written("fsync")
    _publish(tmp, final, written)
    written("rename")
    return final


def _publish(tmp: Path, final: Path, written: WriteHook) -> None:
    """Rename into place. An older checkpoint of the same step (a run resumed from an earlier
    point) is moved aside first; at no moment is a half-written folder visible under a final name.
    """
    if final.exists():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        written("trash")
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def clean_stale(run_dir: Path) -> None:
    """Tidy up after a crash in the middle of a save: a checkpoint moved aside for a replacement
    that never arrived goes back in place; unfinished temporary folders are removed."""
    for p in Path(run_dir).glob(f"{TRASH_PREFIX}{PREFIX}*"):
        final = p.with_name(p.name[len(TRASH_PREFIX) :])
        if not final.exists() and verify(p) is None:
            os.replace(p, final)
    for p in Path(run_dir).glob(".*"):
        if p.is_dir() and p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def discard_all(run_dir: Path) -> int:
    """Remove every checkpoint of an earlier run (output.overwrite): "latest" must never find
    one."""
    old = [p for p in Path(run_dir).glob(f"{PREFIX}*") if p.is_dir()]
    for p in old:
        shutil.rmtree(p)
    clean_stale(run_dir)
    return len(old)


# --------------------------------------------------------------------------------------- finding
def step_of(path: Path) -> int:
    try:
        return int(Path(path).name[len(PREFIX) :])
    except ValueError:
        return -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders that carry a manifest, oldest first (temporary folders are hidden)."""
    found = [
        p
        for p in Path(run_dir).glob(f"{PREFIX}*")
        if p.is_dir() and step_of(p) >= 0 and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=step_of)


def find_latest(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; damaged ones are skipped with a warning."""
    for p in reversed(list_checkpoints(run_dir)):
        problem = verify(p)
        if problem is None:
            return p
        log.warning("skipping damaged checkpoint %s: %s", p, problem)
    return None


def eval_loss_of(path: Path) -> float | None:
    try:
        return json.loads((Path(path) / "state.json").read_text()).get("eval_loss")
    except (OSError, ValueError):
        return None


def find_best(run_dir: Path, among: list[Path] | None = None) -> Path | None:
    """The checkpoint with the lowest eval loss recorded at its own step."""
    ckpts = list_checkpoints(run_dir) if among is None else among
    scored = [(loss, step_of(p), p) for p in ckpts if (loss := eval_loss_of(p)) is not None]
    return min(scored)[2] if scored else None


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints and the best by eval loss.

    Only complete checkpoints count: a damaged or half-removed folder (an interrupted earlier prune,
    a full disk) can never be resumed from, so it must not take the place of a good one. Such
    folders are removed; saving writes into hidden temporary folders, so a folder under a
    checkpoint name is never one still being written."""
    folders = [p for p in Path(run_dir).glob(f"{PREFIX}*") if p.is_dir() and step_of(p) >= 0]
    broken = {p: why for p in folders if (why := verify(p, checksums=False))}
    good = sorted((p for p in folders if p not in broken), key=step_of)
    keep = set(good[-keep_last:]) | {p for p in [find_best(run_dir, good)] if p is not None}
    for p in folders:
        if p in broken:
            log.warning("removing damaged checkpoint %s: %s", p, broken[p])
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------- loading
def load_trainer_state(path: Path) -> dict:
    """Optimizer/scheduler/scaler/RNG states, read without executing pickled code."""
    try:
        return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=True)
    except (
        Exception
    ) as exc:  # torch raises UnpicklingError/RuntimeError for foreign or damaged files
        raise ConfigError(
            f"cannot read {path}/trainer_state.pt: {str(exc).splitlines()[0]}",
            hint="resume from a checkpoint written by onegpu",
        ) from None


def load_checkpoint(path: Path, model, optimizer, scheduler, accelerator) -> dict:
    """Restore weights and optimizer/scheduler/scaler states in place; return the saved TrainState.

    RNG states are returned (under "rng"), not applied: the loop applies them right before its
    first step, after everything else that consumes randomness has been built.
    """
    path = Path(path)
    load_model_weights(path / "model", accelerator.unwrap_model(model))
    blob = load_trainer_state(path)
    try:
        optimizer.load_state_dict(blob["optimizer"])
        scheduler.load_state_dict(blob["scheduler"])
        if accelerator.scaler is not None and blob.get("scaler"):
            accelerator.scaler.load_state_dict(blob["scaler"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(
            f"checkpoint {path} does not match this run's optimizer: {str(exc).splitlines()[0]}",
            hint="resume with the same techniques.optimizer and lora settings it was written with",
        ) from None
    state = json.loads((path / "state.json").read_text())
    state["rng"] = blob["rng"]
    return state


def check_fits(path: Path, model) -> None:
    """One ConfigError, before anything is written, when the checkpoint's weights have other shapes
    than this model's (another size, another vocabulary, another LoRA rank). Only the safetensors
    headers are read. Sharded (engine) checkpoints without a model/ folder are checked by their
    loader."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted((Path(path) / "model").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    _check_shapes(Path(path), shapes, model)


def _check_shapes(path: Path, saved: dict[str, tuple], model) -> None:
    adapters = list(getattr(model, "peft_config", {}) or {})

    def plain(name: str) -> str:
        # the names save_pretrained writes: no compile/checkpointing wrappers, no adapter name
        for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
            name = name.replace(wrapper, "")
        for adapter in adapters:
            name = name.replace(f".{adapter}.", ".")
        return name

    # keep_vars: DeepSpeed ZeRO-3 leaves an empty placeholder with the real shape in ds_shape
    ours = {
        plain(n): tuple(getattr(t, "ds_shape", None) or t.shape)
        for n, t in model.state_dict(keep_vars=True).items()
    }
    for name, shape in saved.items():
        here = ours.get(name)
        if here and all(here) and here != tuple(shape):  # (0,): a placeholder not to compare
            raise ConfigError(
                f"checkpoint {path} was written by a model of another shape: {name} is "
                f"{_shape(shape)} there but {_shape(here)} in this model.",
                hint="resume with the model.name, size, tokenizer and lora settings it was "
                "written with, or start a new run without --output.resume",
            )


def _renamed_on_save(model, tensors: dict) -> bool:
    """save_pretrained wrote the family's original names (transformers 5 reverts its renames on
    save: LLaVA's language_model.model.* for model.language_model.*)."""
    from transformers.core_model_loading import revert_weight_conversion

    names = set(revert_weight_conversion(model, dict(model.state_dict())))
    return set(tensors) <= names and set(tensors) != set(model.state_dict())


def _shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def load_model_weights(model_dir: Path, model) -> None:
    """Load safetensors weights into an existing model (adapters only for a PEFT model)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise ConfigError(
            f"no safetensors weights in {model_dir}.", hint="resume from a complete checkpoint"
        )
    _check_shapes(Path(model_dir).parent, {k: tuple(t.shape) for k, t in tensors.items()}, model)
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, tensors)
        if result.unexpected_keys:
            raise ConfigError(
                f"adapter weights in {model_dir} do not fit this model "
                f"(e.g. {result.unexpected_keys[0]}).",
                hint="resume with the same lora settings",
            )
        return
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    loaded = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in tensors}
    params = dict(model.named_parameters(remove_duplicate=False))
    # save_pretrained writes tied weights (e.g. lm_head = embeddings) once: those are not missing
    missing = [k for k in missing if k in params and id(params[k]) not in loaded]
    if (missing or unexpected) and _renamed_on_save(model, tensors):  # from_pretrained maps them
        loaded = type(model).from_pretrained(str(model_dir), dtype=next(model.parameters()).dtype)
        model.load_state_dict(loaded.state_dict())
        return
    if missing or unexpected:
        key = (missing or unexpected)[0]
        raise ConfigError(
            f"weights in {model_dir} do not fit this model "
            f"({'missing' if missing else 'unexpected'} {key}).",
            hint="resume with the same model.name it was written with",
        )
