"""The training loop, on Accelerate: micro-batches, token-normalised accumulation, eval, logging."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onegpu import assemble, batches, checkpoint, hardware, models
from onegpu.config import Config, from_dict, validate
from onegpu.report import MetricsLog, plot_loss
from onegpu.techniques.loss import count_targets, loss_sum

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    step: int = 0
    batches_seen: int = 0  # micro-batches consumed: the data position
    tokens_seen: int = 0  # real (non-padding) input tokens
    best_eval: float = math.inf
    history: list = field(default_factory=list)  # eval losses

    def to_dict(self) -> dict:
        return {"step": self.step, "batches_seen": self.batches_seen, "tokens_seen": self.tokens_seen,
                "best_eval": self.best_eval, "history": self.history}


@dataclass
class RunResult:
    run_dir: Path
    final_dir: Path
    state: TrainState
    first_eval: float | None
    last_eval: float | None
    wall_seconds: float
    tokens_per_second: float


def train(config: Config | dict | None = None) -> RunResult:
    """Run a training job end to end; the library entry point behind `onegpu train`."""
    from accelerate.utils import set_seed

    from onegpu.techniques.precision import resolve_precision

    cfg = validate(config if isinstance(config, Config) else from_dict(config or {}))
    t_start = time.perf_counter()
    assemble.configure_threads()
    device = hardware.detect()
    precision = resolve_precision(cfg.techniques, device)
    accelerator = assemble.make_accelerator(cfg, device, precision)
    set_seed(cfg.training.seed)
    run_dir = assemble.make_run_dir(cfg, accelerator.is_main_process)
    run = assemble.Run(cfg, device, run_dir, models.resolve_name(cfg.model, device.is_gpu), precision)
    log.info("device: %s; precision %s; model %s", device.name, precision, run.model_name)
    assemble.build_data(run)
    set_seed(cfg.training.seed)  # model init independent of how much randomness data prep used
    assemble.build_model(run)
    assemble.build_optimizer(run)
    if accelerator.is_main_process:
        assemble.save_config(run)
    run.model, run.optimizer = accelerator.prepare(run.model, run.optimizer)
    metrics = MetricsLog(run_dir, cfg.output.tensorboard, enabled=accelerator.is_main_process)
    try:
        state = fit(run, accelerator, metrics)
    finally:
        metrics.close()
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


def fit(run: assemble.Run, accelerator, metrics: MetricsLog) -> TrainState:
    cfg, t = run.cfg, run.cfg.training
    state = TrainState()
    order = batches.BatchOrder(len(run.train_ds), t.micro_batch_size, t.seed, start=state.batches_seen)
    loader = iter(batches.make_loader(run.train_ds, order, run.collator, cfg.data, run.device.is_gpu))
    model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
    bar = _progress(t.max_steps, accelerator.is_main_process)
    deadline = time.perf_counter() + t.max_minutes * 60 if t.max_minutes else math.inf
    window_tokens, window_t0, loss_acc = 0, time.perf_counter(), None
    evaluate_and_log(run, accelerator, metrics, state)  # the untrained baseline: step 0
    model.train()
    while state.step < t.max_steps and time.perf_counter() < deadline:
        micro = [next(loader) for _ in range(t.grad_accum)]
        step_loss, real_tokens = train_step(model, optimizer, micro, accelerator, t.max_grad_norm, run.loss_fn)
        scheduler.step()
        state.step += 1
        state.batches_seen += len(micro)
        state.tokens_seen += real_tokens
        window_tokens += real_tokens
        loss_acc = step_loss if loss_acc is None else loss_acc + step_loss
        if state.step % t.log_every == 0 or state.step == t.max_steps:
            elapsed = time.perf_counter() - window_t0
            n_steps = t.log_every if state.step % t.log_every == 0 else state.step % t.log_every
            rec = {"split": "train", "step": state.step, "loss": float(loss_acc) / n_steps,  # one host sync per log
                   "lr": scheduler.get_last_lr()[0], "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                   "tokens_seen": state.tokens_seen, "memory_gb": device_memory_gb(run.device)}
            metrics.write(rec)
            run.extras["tokens_per_second"] = rec["tokens_per_s"]
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                mem=f"{rec['memory_gb']:.2f}GB", refresh=False)
            window_tokens, window_t0, loss_acc = 0, time.perf_counter(), None
        if bar is not None:
            bar.update(1)
        if t.eval_every and state.step % t.eval_every == 0 and state.step < t.max_steps:
            evaluate_and_log(run, accelerator, metrics, state)
            model.train()
        if t.save_every and state.step % t.save_every == 0:
            save(run, accelerator, state)
    if bar is not None:
        bar.close()
    if not state.history or state.history[-1][0] != state.step:
        evaluate_and_log(run, accelerator, metrics, state)
    state.history = [loss for _, loss in state.history]
    return state


def train_step(model, optimizer, micro: list[dict], accelerator, max_grad_norm: float, loss_fn=loss_sum):
    """One optimizer step over k micro-batches.

    Each micro-batch contributes its *summed* token loss divided by the target-token count of the
    whole accumulated batch (all processes), so the gradient equals that of one big batch however
    the tokens fall across micro-batches. Returns (loss tensor, real input tokens) without syncing.
    """
    n_targets = sum(count_targets(mb["labels"]) for mb in micro)
    n_targets = _global_sum(accelerator, n_targets)
    real_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro)
    total = None
    for i, mb in enumerate(micro):
        mb = {k: v.to(accelerator.device, non_blocking=True) for k, v in mb.items()}
        sync = contextlib.nullcontext() if i == len(micro) - 1 else accelerator.no_sync(model)
        with sync:
            loss = loss_fn(model, mb) / max(n_targets, 1)
            accelerator.backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    if max_grad_norm:
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, real_tokens


def _global_sum(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return value
    import torch

    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum"))


def evaluate(run: assemble.Run, accelerator) -> float | None:
    """Token-weighted validation loss over a fixed set of batches."""
    import torch

    if run.val_ds is None or len(run.val_ds) == 0:
        return None
    t = run.cfg.training
    model = run.model
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    with torch.no_grad():
        for batch in batches.eval_batches(run.val_ds, t.micro_batch_size, run.collator, t.eval_batches):
            count += count_targets(batch["labels"])
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
            total += run.loss_fn(model, batch).float()
    return float(total) / max(count, 1)


def evaluate_and_log(run, accelerator, metrics: MetricsLog, state: TrainState) -> None:
    loss = evaluate(run, accelerator)
    if loss is None:
        return
    state.history.append((state.step, loss))
    state.best_eval = min(state.best_eval, loss)
    metrics.write({"split": "val", "step": state.step, "loss": loss, "perplexity": math.exp(min(loss, 50))})
    if accelerator.is_main_process:
        log.info("step %d: val loss %.4f (ppl %.1f)", state.step, loss, math.exp(min(loss, 50)))


def save(run, accelerator, state: TrainState) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint.save_checkpoint(run.dir, state.step, run.model, run.optimizer, run.scheduler,
                                   state.to_dict(), accelerator, run.tokenizer)
        checkpoint.prune(run.dir, run.cfg.output.keep_last)


def save_final(run, accelerator) -> Path:
    final = run.dir / "final"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(run.model)
        model.save_pretrained(str(final), safe_serialization=True)  # a PeftModel writes only the adapter
        run.tokenizer.save_pretrained(str(final))
        if run.cfg.techniques.lora.enabled and run.cfg.techniques.lora.merge_on_save:
            from onegpu.techniques.lora import save_merged

            merged = save_merged(model, run.dir / "final-merged", run.model_name, run.cfg.model)
            run.tokenizer.save_pretrained(str(merged))
    return final


def device_memory_gb(device) -> float:
    """Peak allocated GPU memory, or the process's resident memory on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**30
    except ImportError:
        return 0.0


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


def print_summary(r: RunResult) -> None:
    first = f"{r.first_eval:.3f}" if r.first_eval is not None else "n/a"
    last = f"{r.last_eval:.3f}" if r.last_eval is not None else "n/a"
    print(f"done: {r.state.step} steps, {r.state.tokens_seen:,} tokens in {r.wall_seconds:.0f}s "
          f"({r.tokens_per_second:,.0f} tokens/s); val loss {first} -> {last}")
    print(f"run directory: {r.run_dir}\n  config.yaml, metrics.jsonl, tensorboard/, loss.png")
    print(f"  model: {r.final_dir}\n  try: onegpu generate --model {r.final_dir} \"def fib(\"")
