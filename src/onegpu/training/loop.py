"""The training loop: cycles of micro-batches, evaluation, logging, checkpoints, signals."""

from __future__ import annotations

import math
import time
from pathlib import Path

from onegpu import distributed
from onegpu.checkpoint import local as checkpoint
from onegpu.checkpoint import sharded as checkpoint_sharded
from onegpu.config import redact, to_dict
from onegpu.report import MetricsLog, device_memory_gb, progress_bar
from onegpu.techniques.optimizer_in_backward import steps_in_backward
from onegpu.training import recovery
from onegpu.training.evaluate import evaluate_and_log
from onegpu.training.state import Callback, TrainState
from onegpu.training.step import train_step


def fit(
    run,
    accelerator,
    metrics: MetricsLog,
    state: TrainState | None = None,
    callbacks: tuple[Callback, ...] = (),
) -> TrainState:
    cfg, t = run.cfg, run.cfg.training
    resumed = state is not None
    state = state or TrainState(
        micro_batch_size=t.micro_batch_size, grad_accum=distributed.global_accum(cfg)
    )
    feed, guard = (
        recovery.DataFeed(run, state),
        recovery.NanGuard(t.max_bad_steps, state.bad_streak),
    )
    model, scheduler = run.model, run.scheduler
    bar = progress_bar(t.max_steps, accelerator.is_main_process, state.step)
    deadline = time.perf_counter() + t.max_minutes * 60 if t.max_minutes else math.inf
    window = {"tokens": 0, "t0": time.perf_counter(), "loss": None, "steps": 0}
    if not resumed:
        evaluate_and_log(run, accelerator, metrics, state)  # the untrained baseline: step 0
        window["t0"] = time.perf_counter()  # training speed leaves the baseline evaluation out
    for cb in callbacks:
        cb.on_train_begin(run, state)
    if getattr(state, "rng", None) is not None:
        checkpoint.set_rng_state(state.rng)  # last, so nothing else consumes the restored streams
    model.train()
    out, rng, last_saved = (), None, state.step if resumed else -1
    with recovery.StopSignal() as stop:
        while state.step < t.max_steps and time.perf_counter() < deadline and not stop.requested:
            rng = (
                checkpoint.rng_state()
            )  # the cycle's start: replayed after an OOM or an interrupted cycle
            out = _step_with_retry(run, accelerator, state, feed, guard, stop, rng)
            if (
                out is None
            ):  # stop requested mid-cycle: save the state as it was at the cycle's start
                break
            scheduler.step()
            state.step += 1
            state.batches_seen += state.grad_accum
            state.tokens_seen += out[1]
            state.bad_streak, state.skipped_steps = guard.bad_streak, guard.skipped
            _log_step(run, metrics, state, window, out, guard.last_bad, bar, callbacks)
            for cb in callbacks:
                cb.on_step_end(run, state)
            if t.eval_every and state.step % t.eval_every == 0 and state.step < t.max_steps:
                evaluate_and_log(run, accelerator, metrics, state)
                model.train()
                window["t0"] = time.perf_counter()  # training speed leaves evaluation out
            if (t.save_every and state.step % t.save_every == 0) or stop.requested:
                save(run, accelerator, state)
                last_saved = state.step
                window["t0"] = time.perf_counter()
        if stop.requested:
            state.stopped = stop.received
            if last_saved != state.step:  # an interrupted cycle restarts from its first micro-batch
                save(run, accelerator, state, rng=rng if out is None else None)
    if bar is not None:
        bar.close()
    if not state.stopped:
        if not state.history or state.history[-1][0] != state.step:
            evaluate_and_log(run, accelerator, metrics, state)
        if t.save_every and last_saved != state.step:
            save(run, accelerator, state)  # a time limit (max_minutes) ended the run between saves
    for cb in callbacks:
        cb.on_train_end(run, state)
    return state


def _step_with_retry(
    run, accelerator, state: TrainState, feed: recovery.DataFeed, guard, stop, rng
):
    """train_step on the next cycle; on out-of-memory, shrink the micro-batch and redo the same
    examples with the same random streams. None when a stop interrupted the cycle."""
    t = run.cfg.training
    # An OOM inside backward after some parameters were already updated cannot be redone exactly.
    retry = t.oom_retry and not steps_in_backward(run.optimizer)
    while True:
        micro = feed.next_cycle()
        try:
            return train_step(
                run.model,
                run.optimizer,
                micro,
                accelerator,
                t.max_grad_norm,
                run.objective,
                guard=guard,
                step=state.step + 1,
                should_stop=lambda: stop.requested,
            )
        except recovery.StepInterrupted:
            return None
        except Exception as exc:  # noqa: BLE001 - only OOM is retried, everything else re-raised
            if not (retry and recovery.is_oom(exc)):
                raise
        # Outside the except block: the exception, its traceback and the failed graph are released.
        run.optimizer.zero_grad(set_to_none=True)
        del micro
        recovery.release_memory()
        feed.shrink()
        checkpoint.set_rng_state(rng)


def _log_step(
    run,
    metrics: MetricsLog,
    state: TrainState,
    window: dict,
    out: tuple,
    skipped: bool,
    bar,
    callbacks: tuple[Callback, ...] = (),
) -> None:
    """Accumulate the logging window without a host sync; write it every log_every steps."""
    t = run.cfg.training
    step_loss, tokens = out
    window["tokens"] += tokens
    if skipped:
        metrics.write(
            {"split": "train", "step": state.step, "skipped": "non-finite loss or gradients"}
        )
    else:
        window["loss"] = step_loss if window["loss"] is None else window["loss"] + step_loss
        window["steps"] += 1
    if not (state.step % t.log_every == 0 or state.step == t.max_steps) or not window["steps"]:
        if bar is not None:
            bar.update(1)
        return
    # One host sync per log, before the clock is read: every step of the window has then finished
    # on the device, so each window is charged for all of its own work and no other's.
    loss = float(window["loss"]) / window["steps"]
    _synchronize(run.device)
    elapsed = time.perf_counter() - window["t0"]
    rec = {
        "split": "train",
        "step": state.step,
        "loss": loss,
        "lr": float(run.scheduler.get_last_lr()[0]),
        "tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
        "tokens_seen": state.tokens_seen,
        "memory_gb": device_memory_gb(run.device),
    }
    # preference objectives: reward accuracy and margin; GRPO: rewards, lengths, clipping, speeds
    rec.update(run.objective.window_metrics())
    metrics.write(rec)
    state.timed_tokens += window["tokens"]
    state.timed_seconds += elapsed
    for cb in callbacks:
        cb.on_log(run, state, rec)
    if bar is not None:
        extra = {}
        if "reward_margin" in rec:
            extra = {
                "margin": f"{rec['reward_margin']:.3f}",
                "acc": f"{rec['reward_accuracy']:.2f}",
            }
        elif "reward" in rec:  # GRPO: the reward, and sampling's speed apart from the whole step's
            extra = {
                "reward": f"{rec['reward']:.3f}",
                "gen_tok_s": f"{rec['gen_tokens_per_s']:.0f}",
            }
        bar.set_postfix(
            loss=f"{rec['loss']:.3f}",
            **extra,
            tok_s=f"{rec['tokens_per_s']:.0f}",
            mem=f"{rec['memory_gb']:.2f}GB",
            refresh=False,
        )
        bar.update(1)
    window.update(tokens=0, t0=time.perf_counter(), loss=None, steps=0)


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def save(run, accelerator, state: TrainState, rng: dict | None = None) -> Path:
    accelerator.wait_for_everyone()
    path = run.dir / f"{checkpoint.PREFIX}{state.step:08d}"
    gathered = None
    if distributed.is_sharded(
        accelerator, run.model
    ):  # FSDP2 / DeepSpeed: every process contributes its shards
        gathered = checkpoint_sharded.gather_sharded(
            run.dir, state.step, run.model, run.optimizer, accelerator
        )
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint.save_checkpoint(
            run.dir,
            state.step,
            run.model,
            run.optimizer,
            run.scheduler,
            state.to_dict(),
            accelerator,
            run.tokenizer,
            redact(to_dict(run.cfg)),
            rng,
            gathered=gathered,
        )
        checkpoint.prune(run.dir, run.cfg.output.keep_last)
    return path
