"""Keeping a run alive, or ending it cleanly: stop signals, non-finite steps, out-of-memory.

* ``StopSignal``: the first SIGTERM/SIGINT asks the loop to stop after the current micro-batch and
  write a checkpoint; a second one exits at once.
* ``NanGuard``: a step whose loss or gradient norm is NaN/inf makes no update; K in a row end the
  run. It reads one scalar per step (the norm the clipping computes anyway).
* ``smaller_micro_batch`` / ``convert_position``: after an out-of-memory error the loop halves the
  micro-batch, doubles accumulation (same effective batch) and retries the same examples.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from onegpu.errors import OnegpuError

log = logging.getLogger(__name__)


class TrainingDiverged(OnegpuError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class StepInterrupted(Exception):
    """A stop was requested in the middle of an accumulation cycle; the cycle was abandoned."""


# ------------------------------------------------------------------------------------- signals
class StopSignal:
    """Context manager turning SIGTERM/SIGINT into a polite stop request.

    Only the main thread may install handlers; elsewhere (e.g. a notebook's worker thread) the
    signals keep their default behaviour.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            # The user insists: leave now. A checkpoint being written stays a hidden temporary
            # folder and is never picked up, so exiting mid-write is safe.
            sys.stderr.write(f"\n{name} again: exiting now without a checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received = name
        sys.stderr.write(
            f"\n{name}: finishing the current micro-batch, then saving a checkpoint "
            f"(send it again to exit at once)\n"
        )
        sys.stderr.flush()


# ----------------------------------------------------------------------------------- NaN guard
class NanGuard:
    """Counts consecutive optimizer steps with a non-finite loss or gradient norm."""

    def __init__(self, max_bad_steps: int, bad_streak: int = 0):
        self.max_bad_steps = max_bad_steps
        self.bad_streak = bad_streak
        self.skipped = 0
        self.last_bad = False

    def is_bad(self, loss, grad_norm) -> bool:
        """One host sync: both checks fold into a single boolean tensor."""
        import torch

        ok = torch.isfinite(loss)
        if grad_norm is not None:
            ok = ok & torch.isfinite(grad_norm.to(ok.device))
        return not bool(ok)

    def record(self, bad: bool, step: int) -> None:
        self.last_bad = bad
        if not bad:
            self.bad_streak = 0
            return
        self.bad_streak += 1
        self.skipped += 1
        log.warning(
            "step %d: non-finite loss or gradients; update skipped (%d in a row, limit %d)",
            step,
            self.bad_streak,
            self.max_bad_steps,
        )
        if self.max_bad_steps and self.bad_streak >= self.max_bad_steps:
            raise TrainingDiverged(
                f"loss or gradients were NaN/inf for {self.bad_streak} steps in a row (last at "
                f"step {step}).",
                hint="lower training.lr, keep training.max_grad_norm on, prefer bf16 to fp16, "
                "check the data, or resume from an earlier checkpoint with --output.resume",
            )


def total_grad_norm(parameters):
    """The global gradient norm, for when clipping is off but the guard still needs its scalar."""
    import torch

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    return torch.nn.utils.get_total_norm(grads)


# ---------------------------------------------------------------------------------------- OOM
def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def smaller_micro_batch(micro_batch_size: int, grad_accum: int) -> tuple[int, int]:
    """Half the micro-batch, twice the accumulation: the effective batch is unchanged.

    An odd size goes straight to 1 (x its size in accumulation) so the product stays exact.
    """
    if micro_batch_size <= 1:
        raise OnegpuError(
            "out of memory even with training.micro_batch_size 1.",
            hint="turn on techniques.checkpointing, lower data.seq_len, use a smaller model, "
            "or techniques.lora / techniques.offload",
        )
    new = micro_batch_size // 2 if micro_batch_size % 2 == 0 else 1
    return new, grad_accum * (micro_batch_size // new)


def convert_position(batches_seen: int, n_examples: int, old_bs: int, new_bs: int) -> int:
    """The same data position counted in micro-batches of ``new_bs`` instead of ``old_bs``.

    BatchOrder shuffles whole epochs with the same seed whatever the batch size, so batch b of size
    2m holds exactly the examples of batches 2b and 2b+1 of size m; the epoch is kept as it was.
    """
    old_per_epoch, new_per_epoch = n_examples // old_bs, n_examples // new_bs
    epoch, offset = divmod(batches_seen, old_per_epoch)
    return epoch * new_per_epoch + offset * old_bs // new_bs


class DataFeed:
    """The micro-batches of one optimizer step at a time, from an exact data position.

    Rebuilt (cheaply) when an out-of-memory retry changes the micro-batch size, at the same
    position counted in the new size, so the retried step sees the same examples.
    """

    def __init__(self, run, state):
        self.run, self.state = run, state
        self._open()

    def _open(self) -> None:
        from onegpu import distributed
        from onegpu.data import batches

        run, s = self.run, self.state
        order = batches.training_order(
            run.cfg,
            len(run.train_ds),
            s.micro_batch_size,
            s.grad_accum,
            start=s.batches_seen,
            rank=distributed.rank(),
            world=distributed.world_size(),
        )
        self.rows_per_epoch = order.rows_per_epoch
        self._it = iter(
            batches.make_loader(run.train_ds, order, run.collator, run.cfg.data, run.device.is_gpu)
        )

    def next_cycle(self) -> list[dict]:
        from onegpu import distributed

        # grad_accum counts the micro-batches of the whole step; this process runs its share
        return [next(self._it) for _ in range(distributed.local_accum(self.state.grad_accum))]

    def shrink(self) -> None:
        s = self.state
        bs, accum = smaller_micro_batch(s.micro_batch_size, s.grad_accum)
        s.batches_seen = convert_position(
            s.batches_seen, self.rows_per_epoch, s.micro_batch_size, bs
        )
        log.warning(
            "step %d: out of memory with micro_batch_size %d; retrying with %d x grad_accum %d "
            "(same effective batch, same examples)",
            s.step + 1,
            s.micro_batch_size,
            bs,
            accum,
        )
        s.micro_batch_size, s.grad_accum = bs, accum
        self._open()


def release_memory() -> None:
    """Give the failed attempt's blocks back before retrying (its tensors are unreachable by
    now)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
