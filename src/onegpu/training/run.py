"""A training run end to end: build everything from a checked config, resume or start fresh,
fit, save the final model and report."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from onegpu import distributed, hardware, hyper, models, trackers
from onegpu.checkpoint import local as checkpoint
from onegpu.checkpoint import resume as checkpoint_resume
from onegpu.checkpoint import sharded as checkpoint_sharded
from onegpu.config import Config
from onegpu.data import batches
from onegpu.report import MetricsLog, plot_loss, print_summary
from onegpu.training import assemble, rundir
from onegpu.training.data import Data, build_data
from onegpu.training.loop import fit
from onegpu.training.state import Callback, RunResult, TrainState

log = logging.getLogger(__name__)


def run_training(cfg: Config, callbacks: tuple[Callback, ...] = ()) -> RunResult:
    """Run a checked configuration (``config.validate``) end to end, exactly as configured: the
    planner, when asked for, has already settled it (see ``onegpu.train``).

    Every input is checked (data read, model built, disk space estimated) before the run directory
    is created, so a bad input leaves nothing behind.
    """
    from accelerate.utils import set_seed

    from onegpu.techniques.precision import resolve_precision
    from onegpu.techniques.prepare import global_switches

    t_start = time.perf_counter()
    assemble.configure_threads()
    device = hardware.detect()
    precision = resolve_precision(cfg.techniques, device)
    with global_switches(cfg, device):
        accelerator = assemble.make_accelerator(cfg, device, precision)
        set_seed(cfg.training.seed)
        # a tracker not installed: refused before any mkdir
        report_to = trackers.resolve(cfg.output.report_to)
        run_dir = rundir.check_run_dir(cfg)
        resume_from = checkpoint_resume.resolve_resume(
            cfg.output.resume, run_dir, cfg.training.objective
        )
        if cfg.training.objective == "grpo":
            _check_grpo_run(cfg)  # a reward that cannot be imported: refused before any load
        model_name = models.resolve_name(cfg.model, device.is_gpu)
        # lr, warm-up and weight decay settled by mode before anything is built; the settled numbers
        # are what config.yaml records, so a resume trains with exactly them
        log.info(hyper.describe(cfg, model_name))
        cfg = _as_saved(hyper.resolve_hyperparameters(cfg, model_name), run_dir)
        log.info("device: %s; precision %s; model %s", device.name, precision, model_name)
        data = build_data(cfg, model_name)
        t = cfg.training  # enough examples for a micro-batch (GRPO: prompts for a step)?
        batches.training_order(cfg, len(data.train_ds), t.micro_batch_size, t.grad_accum)
        set_seed(cfg.training.seed)  # model init independent of how much randomness data prep used
        parts = assemble.assemble(
            cfg, device, precision, model_name, tokenizer=data.tokenizer, accelerator=accelerator
        )
        if (
            resume_from is not None
        ):  # a checkpoint of another model shape fails here, not after the mkdir
            checkpoint.check_fits(resume_from, accelerator.unwrap_model(parts.model))
        rundir.check_disk(parts.model, run_dir)
        fresh = resume_from is None
        with rundir.removed_if_failed_early(run_dir, accelerator.is_main_process, fresh) as first:
            rundir.create_run_dir(run_dir, accelerator.is_main_process)
            if (
                parts.objective.needs_reference == "precomputed"
            ):  # before a resume loads trained weights
                data = _precompute_reference(
                    cfg, data, parts, run_dir, accelerator, resume_from is not None, callbacks
                )
            run = assemble.Run(
                cfg,
                device,
                run_dir,
                model_name,
                precision,
                data,
                parts.model,
                parts.optimizer,
                parts.scheduler,
                parts.objective,
            )
            state = resume(run, accelerator, resume_from) if resume_from else None
            if resume_from is None and accelerator.is_main_process:
                _start_fresh(run_dir)
            if (
                accelerator.is_main_process
            ):  # after a resume that fits, so a failed one leaves the old config
                rundir.save_config(cfg, data.format, run_dir)
            with MetricsLog(
                run_dir,
                report_to,
                enabled=accelerator.is_main_process,
                purge_step=state.step + 1 if state else None,
            ) as metrics:
                state = fit(run, accelerator, metrics, state, (first, *callbacks))
            if state.stopped:
                return _stopped(run, state, time.perf_counter() - t_start)
            final = save_final(run, accelerator)
    wall = time.perf_counter() - t_start
    if accelerator.is_main_process:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    result = RunResult(
        run_dir,
        final,
        state,
        state.first_eval,
        state.last_eval,
        wall,
        state.tokens_per_second,
        data_stats=data.stats,
        sample_prompt=data.sample_prompt,
    )
    if accelerator.is_main_process:
        print_summary(result)
    return result


def _check_grpo_run(cfg: Config) -> None:
    from onegpu.errors import ConfigError
    from onegpu.objectives import rewards

    if distributed.world_size() > 1:
        raise ConfigError(
            "training.objective=grpo runs in one process: its groups of completions are scored "
            "and normalised together.",
            hint="launch a single process (one GPU)",
        )
    rewards.resolve(cfg.grpo, default_job=cfg.data.path is None)
    if cfg.grpo.tools:
        from onegpu.objectives import tools

        tools.resolve(cfg.grpo.tools)


def _precompute_reference(
    cfg: Config,
    data: Data,
    parts: assemble.Prepared,
    run_dir: Path,
    accelerator,
    resumed: bool,
    callbacks: tuple[Callback, ...],
) -> Data:
    """DPO's precomputed reference (objectives/reference.py): the data with the reference log-probs
    of every pair, from the starting weights (or, resumed, read back from the run directory). The
    time of a fresh pass goes to the callbacks (a benchmark charges it to the run)."""
    import dataclasses

    from onegpu.objectives import reference

    train_ds, val_ds, seconds = reference.precompute(
        parts.model,
        parts.objective.tokens,
        data.train_ds,
        data.val_ds,
        data.collator,
        cfg.training.micro_batch_size,
        run_dir,
        accelerator.device,
        resumed,
        accelerator.is_main_process,
    )
    if seconds is not None:
        for cb in callbacks:
            cb.on_reference_pass(seconds)
    return dataclasses.replace(data, train_ds=train_ds, val_ds=val_ds)


def _as_saved(cfg: Config, run_dir: Path) -> Config:
    """The configuration as the run directory records it: its resolved location, and without the
    one-off choices (resume/overwrite), so `--config <run>/config.yaml --output.resume latest`
    continues it."""
    cfg.output.dir, cfg.output.name = str(run_dir.parent.resolve()), run_dir.name
    cfg.output.resume, cfg.output.overwrite = None, False
    return cfg


def resume(run: assemble.Run, accelerator, path: Path) -> TrainState:
    """Restore model, optimizer, scheduler, scaler and data position from a checkpoint."""
    if distributed.is_sharded(
        accelerator, run.model
    ):  # FSDP2 / DeepSpeed: every process loads its shards
        saved = checkpoint_sharded.load_sharded(
            path, run.model, run.optimizer, run.scheduler, accelerator
        )
    else:
        saved = checkpoint.load_checkpoint(
            path, run.model, run.optimizer, run.scheduler, accelerator
        )
    state = TrainState.from_dict(saved)
    state.rng = saved["rng"]
    t = run.cfg.training
    if (state.micro_batch_size, state.grad_accum) != (t.micro_batch_size, t.grad_accum):
        log.info(
            "resuming with micro_batch_size %d x grad_accum %d as the checkpoint ran (config: %d x "
            "%d)",
            state.micro_batch_size,
            state.grad_accum,
            t.micro_batch_size,
            t.grad_accum,
        )
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
    print(
        f"stopped by {state.stopped} at step {state.step}; checkpoint saved: {ckpt}\n"
        f"resume with: onegpu train --config {run.dir / 'config.yaml'} --output.resume latest"
    )
    return RunResult(
        run.dir,
        ckpt,
        state,
        state.first_eval,
        state.last_eval,
        wall,
        state.tokens_per_second,
        stopped=state.stopped,
        data_stats=run.data.stats,
    )


def save_final(run, accelerator) -> Path:
    final = run.dir / "final"
    accelerator.wait_for_everyone()
    # FSDP2 / DeepSpeed ZeRO-3: gather the full weights (a collective: every process takes part)
    full = (
        distributed.full_state_dict(accelerator, run.model)
        if distributed.is_sharded(accelerator, run.model)
        else None
    )
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(run.model)
        model.save_pretrained(
            str(final), safe_serialization=True, state_dict=full
        )  # PeftModel: the adapter
        models.save_tokenizer(run.tokenizer, final)
        if run.data.processor is not None:  # a vision-language model reloads with its processor
            run.data.processor.save_pretrained(str(final))
        if run.cfg.techniques.lora.enabled and run.cfg.techniques.lora.merge_on_save:
            from onegpu.techniques.lora import save_merged

            merged = save_merged(model, run.dir / "final-merged", run.model_name, run.cfg.model)
            models.save_tokenizer(run.tokenizer, merged)
            if run.data.processor is not None:
                run.data.processor.save_pretrained(str(merged))
    return final
