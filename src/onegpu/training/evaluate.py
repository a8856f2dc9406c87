"""Validation: token-weighted loss over a fixed set of batches, logged with its perplexity
(pair-weighted, with the reward accuracy and margin, for preference objectives)."""

from __future__ import annotations

import logging
import math

from onegpu.data import batches
from onegpu.objectives.tokens import with_target_positions

log = logging.getLogger(__name__)


def evaluate(run, accelerator) -> tuple[float, dict] | None:
    """(validation loss, the objective's evaluation metrics) over a fixed set of batches; the loss
    is normalised as the step normalises it (target tokens, or pairs)."""
    import torch

    if run.val_ds is None or len(run.val_ds) == 0:
        return None
    t = run.cfg.training
    model = run.model
    model.eval()
    objective = run.objective
    objective.begin_eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    # Compiled blocks run eagerly here: a handful of batches does not repay compiling the
    # no-grad variant of every block (another full compile on a CPU).
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        size = objective.eval_batch_size(t.micro_batch_size)
        for examples in batches.eval_batches(run.val_ds, size, run.collator, t.eval_batches):
            for batch in objective.eval_micro(model, examples):
                batch = with_target_positions(batch)  # on the host: the target rows and count
                count += objective.count(batch)
                batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
                total += objective.loss(model, batch).float()
    # the objective's figures of the validation pairs (rewards), apart from training's window
    return float(total) / max(count, 1), objective.eval_metrics()


def evaluate_and_log(run, accelerator, metrics, state) -> None:
    out = evaluate(run, accelerator)
    if out is None:
        return
    loss, rewards = out
    state.history.append((state.step, loss))
    state.best_eval = min(state.best_eval, loss)
    rec = {"split": "val", "step": state.step, "loss": loss}
    if rewards:  # preference tuning, RL: a perplexity of their losses means nothing
        rec.update(rewards)
        if accelerator.is_main_process and "reward" in rewards:
            log.info("step %d: val loss %.4f, reward %.3f", state.step, loss, rewards["reward"])
        elif accelerator.is_main_process:
            log.info(
                "step %d: val loss %.4f, reward accuracy %.3f, margin %.4f",
                state.step,
                loss,
                rewards["reward_accuracy"],
                rewards["reward_margin"],
            )
        metrics.write(rec)
        return
    rec["perplexity"] = math.exp(min(loss, 50))
    metrics.write(rec)
    if accelerator.is_main_process:
        log.info("step %d: val loss %.4f (ppl %.1f)", state.step, loss, math.exp(min(loss, 50)))
