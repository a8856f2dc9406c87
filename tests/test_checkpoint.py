"""Checkpoint format: complete-or-absent folders, verified manifests, weights_only-safe state."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from helpers import Parts, make_tiny_llama
from onegpu.checkpoint import local as checkpoint
from onegpu.checkpoint import resume
from onegpu.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


@pytest.fixture
def parts(tiny_tokenizer):
    torch.manual_seed(0)
    return Parts(tiny_tokenizer)


def test_layout_manifest_and_weights_only_load(tmp_path, parts):
    parts.step()
    path = parts.save(tmp_path, 1)
    assert path.name == "checkpoint-00000001"
    for name in (
        "model/model.safetensors",
        "model/config.json",
        "model/tokenizer.json",
        "trainer_state.pt",
        "state.json",
        "config.yaml",
        "manifest.json",
    ):
        assert (path / name).is_file(), name
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) >= {"model/model.safetensors", "trainer_state.pt", "state.json"}
    assert checkpoint.verify(path) is None
    # every object in trainer_state.pt loads under the restricted unpickler
    blob = torch.load(path / "trainer_state.pt", weights_only=True)
    assert set(blob) == {"optimizer", "scheduler", "scaler", "rng"}
    assert not list(tmp_path.glob(".tmp-*"))


def test_load_restores_model_and_optimizer_exactly(tmp_path, parts, tiny_tokenizer):
    parts.step()
    path = parts.save(tmp_path, 1)
    other = Parts(tiny_tokenizer)
    torch.manual_seed(123)
    other.model = make_tiny_llama(tiny_tokenizer, initializer_range=0.5)
    other.optimizer = torch.optim.AdamW(other.model.parameters(), lr=1e-3)
    other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda s: 1.0 / (s + 1))
    state = checkpoint.load_checkpoint(
        path, other.model, other.optimizer, other.scheduler, other.accelerator
    )
    assert state["step"] == 1 and "rng" in state
    for (n, a), (_, b) in zip(
        parts.model.state_dict().items(), other.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n
    sa, sb = parts.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    assert other.scheduler.last_epoch == parts.scheduler.last_epoch


def test_rng_state_roundtrip_through_weights_only(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.randn(), torch.randn(1)  # noqa: B018 - leave a cached gaussian too
    saved = checkpoint.rng_state()
    torch.save(saved, tmp_path / "rng.pt")
    expected = (random.random(), np.random.randn(), torch.randn(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.randn(), torch.randn(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


@pytest.mark.parametrize(
    "damage", ["truncate-weights", "flip-byte-state", "delete-optimizer", "no-manifest"]
)
def test_damaged_checkpoint_is_never_picked(tmp_path, parts, damage):
    older = parts.save(tmp_path, 1)
    parts.step()
    newer = parts.save(tmp_path, 2)
    if damage == "truncate-weights":
        f = newer / "model" / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip-byte-state":
        f = newer / "trainer_state.pt"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif damage == "delete-optimizer":
        (newer / "trainer_state.pt").unlink()
    else:
        (newer / "manifest.json").unlink()
    assert checkpoint.verify(newer) is not None
    assert checkpoint.find_latest(tmp_path) == older
    assert resume.resolve_resume("latest", tmp_path) == older
    if damage != "no-manifest":
        with pytest.raises(ConfigError, match="damaged"):
            resume.resolve_resume(str(newer), tmp_path)


def test_keep_last_and_best(tmp_path, parts):
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, None)]:
        parts.save(tmp_path, step, eval_loss=loss)
        checkpoint.prune(tmp_path, keep_last=2)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [2, 4, 5]
    assert checkpoint.find_best(tmp_path).name == "checkpoint-00000002"


@pytest.mark.parametrize("point", ["model", "manifest", "fsync", "trash"])
def test_resave_same_step_replaces_atomically(tmp_path, parts, point):
    """A run resumed from an earlier point saves a step again. A crash at any moment of that save,
    the old folder already moved aside ("trash") included, leaves the old checkpoint whole; the
    next save replaces it with the new weights."""
    from safetensors.torch import load_file

    def saved_weights(path):
        return load_file(str(path / "model" / "model.safetensors"))

    first = parts.save(tmp_path, 3)
    old = saved_weights(first)
    parts.step()

    def crash(at):
        if at == point:
            raise SystemExit(f"crash at {at}")

    with pytest.raises(SystemExit):
        parts.save(tmp_path, 3, on_write=crash)
    assert any(p.name.startswith(".") for p in tmp_path.iterdir())  # a half-done save is left
    latest = resume.resolve_resume("latest", tmp_path)  # what a resume picks after the crash
    assert latest == first and checkpoint.verify(latest) is None
    assert all(torch.equal(old[k], v) for k, v in saved_weights(latest).items())

    second = parts.save(tmp_path, 3)
    assert second == first and checkpoint.verify(second) is None
    new = saved_weights(second)
    assert not all(torch.equal(old[k], v) for k, v in new.items())  # the step's new weights
    assert all(
        torch.equal(p.detach(), new[n]) for n, p in parts.model.named_parameters() if n in new
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "point", ["model", "tokenizer", "trainer_state", "state", "config", "manifest", "fsync"]
)
def test_crash_before_rename_leaves_previous_checkpoint(tmp_path, parts, point):
    """An exception at each write stands in for a crash; test_killpoints does it with kill -9."""
    good = parts.save(tmp_path, 1)

    def crash(at):
        if at == point:
            raise SystemExit(f"crash at {at}")

    with pytest.raises(SystemExit):
        parts.save(tmp_path, 2, on_write=crash)
    assert checkpoint.find_latest(tmp_path) == good
    parts.save(tmp_path, 2)  # the next save clears the leftover temporary folder
    assert not list(tmp_path.glob(".tmp-*"))


def test_resume_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resume.resolve_resume("latest", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resume.resolve_resume("latest", tmp_path / "empty")


def test_foreign_pickle_is_refused(tmp_path, parts):
    path = parts.save(tmp_path, 1)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"optimizer": Evil()}, path / "trainer_state.pt")
    with pytest.raises(ConfigError, match="cannot read"):
        checkpoint.load_trainer_state(path)


def test_other_model_shape_is_one_error_naming_parameter_and_shapes(
    tmp_path, parts, tiny_tokenizer
):
    path = parts.save(tmp_path, 1)
    wide = make_tiny_llama(tiny_tokenizer, hidden_size=96, intermediate_size=128)
    vocab = len(tiny_tokenizer)
    expect = (
        rf"checkpoint {path} was written by a model of another shape: lm_head\.weight is "
        rf"\({vocab}, 64\) there but \({vocab}, 96\) in this model"
    )
    with pytest.raises(ConfigError, match=expect) as err:
        checkpoint.check_fits(
            path, wide
        )  # headers only: run_training calls it before the run folder exists
    assert "without --output.resume" in err.value.hint
    opt = torch.optim.AdamW(wide.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(
        ConfigError, match=expect
    ):  # loading says the same, never a size-mismatch traceback
        checkpoint.load_checkpoint(path, wide, opt, sched, parts.accelerator)
    checkpoint.check_fits(path, parts.model)  # the same shape passes


def test_lora_rank_mismatch_is_named(tmp_path, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    def lora(r):
        torch.manual_seed(0)
        return get_peft_model(
            make_tiny_llama(tiny_tokenizer), LoraConfig(r=r, target_modules=["q_proj"])
        )

    saved = lora(4)
    saved.save_pretrained(str(tmp_path / "ckpt" / "model"))
    with pytest.raises(
        ConfigError, match=r"lora_A\.weight is \(4, 64\) there but \(8, 64\) in this model"
    ):
        checkpoint.check_fits(tmp_path / "ckpt", lora(8))
    checkpoint.check_fits(tmp_path / "ckpt", lora(4))


@pytest.mark.parametrize("damage", ["half-pruned", "no-manifest", "cut-weights"])
def test_damaged_checkpoint_never_takes_a_good_ones_place(tmp_path, parts, damage):
    for step in (1, 2, 3):
        parts.save(tmp_path, step)
        checkpoint.prune(tmp_path, keep_last=2)
    newest = tmp_path / "checkpoint-00000003"
    if damage == "half-pruned":  # an earlier prune interrupted part-way
        (newest / "trainer_state.pt").unlink()
        shutil.rmtree(newest / "model")
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    else:
        f = newest / "model" / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    parts.save(tmp_path, 4)
    checkpoint.prune(tmp_path, keep_last=2)
    # two complete checkpoints kept (2 and 4); the damaged one neither counted nor kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000002",
        "checkpoint-00000004",
    ]
    assert all(checkpoint.verify(p) is None for p in checkpoint.list_checkpoints(tmp_path))
