"""Data preloading: worker processes really prepare batches, in the same order; pinning only on a
GPU; host-to-device copies are asynchronous."""

from __future__ import annotations

import logging
import os

import torch

from onegpu.config import DataConfig
from onegpu.data.batches import BatchOrder, Collator, make_loader


class TaggingCollator(Collator):
    """Records which process and DataLoader worker built each batch."""

    def __call__(self, examples):
        batch = super().__call__(examples)
        info = torch.utils.data.get_worker_info()
        batch["worker"] = torch.tensor(-1 if info is None else info.id)
        batch["pid"] = torch.tensor(os.getpid())
        return batch


def _dataset(n=48):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(1, 100, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def _batches(num_workers: int, count: int = 8):
    cfg = DataConfig(num_workers=num_workers, prefetch_factor=2, persistent_workers=False)
    order = BatchOrder(48, 4, seed=7)
    loader = make_loader(_dataset(), order, TaggingCollator(0, multiple=8), cfg, on_gpu=False)
    it = iter(loader)
    return [next(it) for _ in range(count)]


def test_workers_build_batches_in_other_processes_with_identical_content():
    serial, parallel = _batches(0), _batches(2)
    assert {int(b["worker"]) for b in serial} == {-1} and {int(b["pid"]) for b in serial} == {
        os.getpid()
    }
    assert {int(b["worker"]) for b in parallel} == {0, 1}  # round-robin over both workers
    assert os.getpid() not in {int(b["pid"]) for b in parallel}
    for a, b in zip(serial, parallel, strict=True):
        for key in ("input_ids", "labels", "attention_mask"):
            assert torch.equal(a[key], b[key]), key


def test_worker_settings_reach_the_loader():
    cfg = DataConfig(num_workers=2, prefetch_factor=3, persistent_workers=True)
    loader = make_loader(_dataset(), BatchOrder(48, 4, seed=7), Collator(0), cfg, on_gpu=False)
    assert loader.num_workers == 2 and loader.prefetch_factor == 3 and loader.persistent_workers


def test_pin_memory_only_on_gpu(caplog):
    cfg = DataConfig(pin_memory=True)
    with caplog.at_level(logging.INFO, logger="onegpu.data.batches"):
        cpu = make_loader(_dataset(), BatchOrder(48, 4, seed=7), Collator(0), cfg, on_gpu=False)
    assert cpu.pin_memory is False and "pin_memory" in caplog.text
    gpu = make_loader(_dataset(), BatchOrder(48, 4, seed=7), Collator(0), cfg, on_gpu=True)
    assert gpu.pin_memory is True
    off = make_loader(
        _dataset(),
        BatchOrder(48, 4, seed=7),
        Collator(0),
        DataConfig(pin_memory=False),
        on_gpu=True,
    )
    assert off.pin_memory is False


class RecordingTensor(torch.Tensor):
    """Notes the non_blocking flag of every .to() call made on it."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.calls.append(bool(kwargs.get("non_blocking", False)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def test_train_step_copies_batches_non_blocking(tiny_tokenizer):
    from accelerate import Accelerator

    from helpers import make_tiny_llama
    from onegpu.training.step import train_step

    model = make_tiny_llama(tiny_tokenizer)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = Collator(tiny_tokenizer.pad_token_id, 8)(
        [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 2
    )
    micro = [{k: v.as_subclass(RecordingTensor) for k, v in batch.items()}]
    RecordingTensor.calls.clear()
    train_step(model, opt, micro, Accelerator(cpu=True), 1.0)
    # The first copies are the batch moving to the device; later .to() calls (inside the loss, on
    # tensors already there) are no-ops whatever their flag.
    assert len(RecordingTensor.calls) >= len(batch) and all(RecordingTensor.calls[: len(batch)])
