"""The training loop, on Accelerate: micro-batches, token-normalised accumulation, eval, logging."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onegpu import assemble, batches, checkpoint, checkpoint_sharded, distributed, hardware, models, recovery
from onegpu.config import Config, from_dict, redact, to_dict, validate
from onegpu.evaluate import evaluate_and_log
from onegpu.report import MetricsLog, device_memory_gb, plot_loss, print_summary, progress_bar
from onegpu.techniques.loss import TARGETS, loss_sum, with_target_positions

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    batches_seen: int = 0  # micro-batches (of micro_batch_size) of completed steps: the data position
    tokens_seen: int = 0  # real (non-padding) input tokens
    best_eval: float = math.inf
    history: list = field(default_factory=list)  # eval losses
    micro_batch_size: int = 0  # current sizes: an out-of-memory retry changes them mid-run
    grad_accum: int = 0
    skipped_steps: int = 0  # updates skipped for a non-finite loss/gradient
    bad_streak: int = 0
    stopped: str | None = None  # the signal that stopped the run early, if any
    rng: Any = field(default=None, repr=False)  # RNG states restored from a checkpoint, applied by fit()

    def to_dict(self) -> dict:
        last = self.history[-1] if self.history else None
        return {"step": self.step, "batches_seen": self.batches_seen, "tokens_seen": self.tokens_seen,
                "best_eval": self.best_eval, "history": self.history, "micro_batch_size": self.micro_batch_size,
                "grad_accum": self.grad_accum, "skipped_steps": self.skipped_steps, "bad_streak": self.bad_streak,
                "eval_loss": last[1] if last and last[0] == self.step else None}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(step=d["step"], batches_seen=d["batches_seen"], tokens_seen=d["tokens_seen"],
                   best_eval=d["best_eval"], history=[tuple(h) for h in d["history"]],
                   micro_batch_size=d.get("micro_batch_size", 0), grad_accum=d.get("grad_accum", 0),
                   skipped_steps=d.get("skipped_steps", 0), bad_streak=d.get("bad_streak", 0))


@dataclass
class RunResult:
    run_dir: Path
    final_dir: Path
    state: TrainState
    first_eval: float | None
    last_eval: float | None
    wall_seconds: float
    tokens_per_second: float
    stopped: str | None = None  # set when a signal ended the run early; final_dir is then its checkpoint


def train(config: Config | dict | None = None) -> RunResult:
    """Run a training job end to end; the library entry point behind `onegpu train`.

    Every input is checked (data read, model built, disk space estimated) before the run directory
    is created, so a bad input leaves nothing behind.
    """
    from accelerate.utils import set_seed

    from onegpu.techniques.precision import resolve_precision

    cfg = validate(copy.deepcopy(config) if isinstance(config, Config) else from_dict(config or {}))
    if cfg.plan == "auto":  # settle the setup by measurement before anything is built for real
        from onegpu.plan.probe import auto_plan

        cfg = validate(auto_plan(cfg))
    t_start = time.perf_counter()
    assemble.configure_threads()
    device = hardware.detect()
    precision = resolve_precision(cfg.techniques, device)
    accelerator = assemble.make_accelerator(cfg, device, precision)
    set_seed(cfg.training.seed)
    run_dir = assemble.check_run_dir(cfg)
    resume_from = checkpoint.resolve_resume(cfg.output.resume, run_dir)
    cfg = _as_saved(cfg, run_dir)
    run = assemble.Run(cfg, device, run_dir, models.resolve_name(cfg.model, device.is_gpu), precision)
    log.info("device: %s; precision %s; model %s", device.name, precision, run.model_name)
    assemble.build_data(run)
    set_seed(cfg.training.seed)  # model init independent of how much randomness data prep used
    assemble.build_model(run)
    run.model = distributed.apply_fsdp2(run.model, cfg, precision, accelerator)  # before the optimizer sees the params
    assemble.build_optimizer(run)
    batches.BatchOrder(len(run.train_ds), cfg.training.micro_batch_size, cfg.training.seed)  # enough examples?
    assemble.check_disk(run)
    assemble.create_run_dir(run_dir, accelerator.is_main_process)
    run.model, run.optimizer = distributed.prepare(accelerator, run.model, run.optimizer)
    state = resume(run, accelerator, resume_from) if resume_from else None
    if resume_from is None and accelerator.is_main_process:
        _start_fresh(run_dir)
    if accelerator.is_main_process:  # after a resume that fits, so a failed one leaves the old config
        assemble.save_config(run)
    metrics = MetricsLog(run_dir, cfg.output.tensorboard, enabled=accelerator.is_main_process,
                         purge_step=state.step + 1 if state else None)
    try:
        state = fit(run, accelerator, metrics, state)
    finally:
        metrics.close()
    if state.stopped:
        return _stopped(run, state, time.perf_counter() - t_start)
    final = save_final(run, accelerator)
    wall = time.perf_counter() - t_start
    if accelerator.is_main_process:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    hist = state.history
    result = RunResult(run_dir, final, state, hist[0] if hist else None, hist[-1] if hist else None, wall,
                       run.extras.get("tokens_per_second", 0.0))
    if accelerator.is_main_process:
        print_summary(result)
    return result


def _as_saved(cfg: Config, run_dir: Path) -> Config:
    """The configuration as the run directory records it: its resolved location, and without the
    one-off choices (resume/overwrite), so `--config <run>/config.yaml --output.resume latest` continues it."""
    cfg.output.dir, cfg.output.name = str(run_dir.parent.resolve()), run_dir.name
    cfg.output.resume, cfg.output.overwrite = None, False
    return cfg


def resume(run: assemble.Run, accelerator, path: Path) -> TrainState:
    """Restore model, optimizer, scheduler, scaler and data position from a checkpoint."""
    if distributed.is_sharded(accelerator, run.model):  # FSDP2 / DeepSpeed: every process loads its shards
        saved = checkpoint_sharded.load_sharded(path, run.model, run.optimizer, run.scheduler, accelerator)
    else:
        saved = checkpoint.load_checkpoint(path, run.model, run.optimizer, run.scheduler, accelerator)
    state = TrainState.from_dict(saved)
    state.rng = saved["rng"]
    t = run.cfg.training
    if (state.micro_batch_size, state.grad_accum) != (t.micro_batch_size, t.grad_accum):
        log.info("resuming with micro_batch_size %d x grad_accum %d as the checkpoint ran (config: %d x %d)",
                 state.micro_batch_size, state.grad_accum, t.micro_batch_size, t.grad_accum)
    if accelerator.is_main_process:
        _trim_metrics(run.dir / "metrics.jsonl", state.step)
    log.info("resumed from %s at step %d", path, state.step)
    return state


def _trim_metrics(path: Path, step: int) -> None:
    """Drop records written after the checkpoint (the steps being redone), so the log continues
    exactly where the resumed state is."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if rec.get("step", 0) <= step:
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


def _start_fresh(run_dir: Path) -> None:
    """A new run in a used directory (output.overwrite): drop the old run's checkpoints and metrics
    so that neither a later resume nor the log mixes the two runs."""
    n = checkpoint.discard_all(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if n or metrics.exists():
        log.info("overwriting %s: removed %d old checkpoint(s) and its metrics", run_dir, n)
        metrics.unlink(missing_ok=True)


def _stopped(run, state: TrainState, wall: float) -> RunResult:
    ckpt = run.dir / f"{checkpoint.PREFIX}{state.step:08d}"
    hist = [h for h in state.history]
    print(f"stopped by {state.stopped} at step {state.step}; checkpoint saved: {ckpt}\n"
          f"resume with: onegpu train --config {run.dir / 'config.yaml'} --output.resume latest")
    return RunResult(run.dir, ckpt, state, hist[0] if hist else None, hist[-1] if hist else None, wall,
                     run.extras.get("tokens_per_second", 0.0), stopped=state.stopped)


def fit(run: assemble.Run, accelerator, metrics: MetricsLog, state: TrainState | None = None) -> TrainState:
    cfg, t = run.cfg, run.cfg.training
    resumed = state is not None
    state = state or TrainState(micro_batch_size=t.micro_batch_size, grad_accum=distributed.global_accum(cfg))
    feed, guard = recovery.DataFeed(run, state), recovery.NanGuard(t.max_bad_steps, state.bad_streak)
    model, scheduler = run.model, run.scheduler
    bar = progress_bar(t.max_steps, accelerator.is_main_process, state.step)
    deadline = time.perf_counter() + t.max_minutes * 60 if t.max_minutes else math.inf
    window = {"tokens": 0, "t0": time.perf_counter(), "loss": None, "steps": 0}
    if not resumed:
        evaluate_and_log(run, accelerator, metrics, state)  # the untrained baseline: step 0
    if getattr(state, "rng", None) is not None:
        checkpoint.set_rng_state(state.rng)  # last, so nothing else consumes the restored streams
    model.train()
    out, rng, last_saved = (), None, state.step if resumed else -1
    with recovery.StopSignal() as stop:
        while state.step < t.max_steps and time.perf_counter() < deadline and not stop.requested:
            rng = checkpoint.rng_state()  # the cycle's start: replayed after an OOM or an interrupted cycle
            out = _step_with_retry(run, accelerator, state, feed, guard, stop, rng)
            if out is None:  # stop requested mid-cycle: save the state as it was at the cycle's start
                break
            scheduler.step()
            state.step += 1
            state.batches_seen += state.grad_accum
            state.tokens_seen += out[1]
            state.bad_streak, state.skipped_steps = guard.bad_streak, guard.skipped
            _log_step(run, metrics, state, window, out, guard.last_bad, bar)
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
    if state.stopped:
        return state
    if not state.history or state.history[-1][0] != state.step:
        evaluate_and_log(run, accelerator, metrics, state)
    if t.save_every and last_saved != state.step:
        save(run, accelerator, state)  # a time limit (max_minutes) ended the run between saves
    state.history = [loss for _, loss in state.history]
    return state


def _step_with_retry(run, accelerator, state: TrainState, feed: recovery.DataFeed, guard, stop, rng):
    """train_step on the next cycle; on out-of-memory, shrink the micro-batch and redo the same
    examples with the same random streams. None when a stop interrupted the cycle."""
    t = run.cfg.training
    while True:
        micro = feed.next_cycle()
        try:
            return train_step(run.model, run.optimizer, micro, accelerator, t.max_grad_norm, run.loss_fn,
                              guard=guard, step=state.step + 1, should_stop=lambda: stop.requested)
        except recovery.StepInterrupted:
            return None
        except Exception as exc:  # noqa: BLE001 - only OOM is retried, everything else re-raised
            if not (t.oom_retry and recovery.is_oom(exc)):
                raise
        # Outside the except block: the exception, its traceback and the failed graph are released.
        run.optimizer.zero_grad(set_to_none=True)
        del micro
        recovery.release_memory()
        feed.shrink()
        checkpoint.set_rng_state(rng)


def _log_step(run, metrics: MetricsLog, state: TrainState, window: dict, out: tuple, skipped: bool, bar) -> None:
    """Accumulate the logging window without a host sync; write it every log_every steps."""
    t = run.cfg.training
    step_loss, tokens = out
    window["tokens"] += tokens
    if skipped:
        metrics.write({"split": "train", "step": state.step, "skipped": "non-finite loss or gradients"})
    else:
        window["loss"] = step_loss if window["loss"] is None else window["loss"] + step_loss
        window["steps"] += 1
    if not (state.step % t.log_every == 0 or state.step == t.max_steps) or not window["steps"]:
        if bar is not None:
            bar.update(1)
        return
    elapsed = time.perf_counter() - window["t0"]
    rec = {"split": "train", "step": state.step, "loss": float(window["loss"]) / window["steps"],  # one sync per log
           "lr": float(run.scheduler.get_last_lr()[0]), "tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
           "tokens_seen": state.tokens_seen, "memory_gb": device_memory_gb(run.device)}
    metrics.write(rec)
    # The run's figure: all training windows together (the log shows each window's own).
    run.extras["timed_tokens"] = run.extras.get("timed_tokens", 0) + window["tokens"]
    run.extras["timed_seconds"] = run.extras.get("timed_seconds", 0.0) + elapsed
    run.extras["tokens_per_second"] = run.extras["timed_tokens"] / max(run.extras["timed_seconds"], 1e-9)
    if bar is not None:
        bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                        mem=f"{rec['memory_gb']:.2f}GB", refresh=False)
        bar.update(1)
    window.update(tokens=0, t0=time.perf_counter(), loss=None, steps=0)


def train_step(model, optimizer, micro: list[dict], accelerator, max_grad_norm: float, loss_fn=loss_sum,
               guard: recovery.NanGuard | None = None, step: int = 0, should_stop=None):
    """One optimizer step over k micro-batches.

    Each micro-batch contributes its *summed* token loss divided by the target-token count of the
    whole accumulated batch (all processes), so the gradient equals that of one big batch however
    the tokens fall across micro-batches. Returns (loss tensor, real input tokens) without syncing,
    except for the guard's one scalar: a NaN/inf loss or gradient norm skips the update.
    ``should_stop`` is polled between micro-batches; if it turns true the partial cycle is dropped
    (no update was made yet) and StepInterrupted is raised.
    """
    micro = [with_target_positions(mb) for mb in micro]  # on the host: the target rows, and so their count
    n_targets = _global_sum(accelerator, sum(mb[TARGETS].numel() for mb in micro))
    real_tokens = _global_sum(accelerator, sum(int(mb["attention_mask"].sum()) for mb in micro))
    total = None
    for i, mb in enumerate(micro):
        if i and should_stop is not None and should_stop():
            optimizer.zero_grad(set_to_none=True)
            raise recovery.StepInterrupted()
        mb = {k: v.to(accelerator.device, non_blocking=True) for k, v in mb.items()}
        with distributed.accumulating(accelerator, model, last=i == len(micro) - 1):
            loss = loss_fn(model, mb) / max(n_targets, 1)
            distributed.backward(accelerator, loss)
        total = loss.detach() if total is None else total + loss.detach()
    total = distributed.global_loss(accelerator, total)  # the same value, and NaN verdict, on every rank
    norm = distributed.clip_grad_norm(accelerator, model, max_grad_norm) if max_grad_norm else None
    bad = False
    if guard is not None:
        if norm is None and accelerator.scaler is None:
            norm = recovery.total_grad_norm(model.parameters())
        # With fp16 loss scaling, inf gradients are routine and the scaler itself skips those steps.
        bad = guard.is_bad(total, None if accelerator.scaler is not None else norm)
        guard.record(bad, step)
    if not bad:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, real_tokens


def _global_sum(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return value
    import torch

    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum"))




def save(run, accelerator, state: TrainState, rng: dict | None = None) -> Path:
    accelerator.wait_for_everyone()
    path = run.dir / f"{checkpoint.PREFIX}{state.step:08d}"
    gathered = None
    if distributed.is_sharded(accelerator, run.model):  # FSDP2 / DeepSpeed: every process contributes its shards
        gathered = checkpoint_sharded.gather_sharded(run.dir, state.step, run.model, run.optimizer, accelerator)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint.save_checkpoint(run.dir, state.step, run.model, run.optimizer, run.scheduler,
                                   state.to_dict(), accelerator, run.tokenizer, redact(to_dict(run.cfg)), rng,
                                   gathered=gathered)
        checkpoint.prune(run.dir, run.cfg.output.keep_last)
    return path


def save_final(run, accelerator) -> Path:
    final = run.dir / "final"
    accelerator.wait_for_everyone()
    # FSDP2 / DeepSpeed ZeRO-3: gather the full weights (a collective: every process takes part)
    full = distributed.full_state_dict(accelerator, run.model) if distributed.is_sharded(accelerator, run.model) else None
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(run.model)
        model.save_pretrained(str(final), safe_serialization=True, state_dict=full)  # PeftModel: the adapter
        run.tokenizer.save_pretrained(str(final))
        if run.cfg.techniques.lora.enabled and run.cfg.techniques.lora.merge_on_save:
            from onegpu.techniques.lora import save_merged

            merged = save_merged(model, run.dir / "final-merged", run.model_name, run.cfg.model)
            run.tokenizer.save_pretrained(str(merged))
    return final





class _CallableModule(types.ModuleType):
    """`onegpu.train(config)` is the library entry point, and `onegpu.train` is also this module's
    name: once the module is imported it shadows any function of that name on the package, so the
    module itself answers the call."""

    def __call__(self, config: Config | dict | None = None) -> RunResult:
        return train(config)


sys.modules[__name__].__class__ = _CallableModule
