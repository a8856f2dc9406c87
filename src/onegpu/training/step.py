"""One optimizer step over k micro-batches: the only training step there is. Training, the
planner's probes and its accuracy check all call it, so they share one loss normalisation."""

from __future__ import annotations

from onegpu import distributed
from onegpu.objectives import Objective
from onegpu.objectives.tokens import with_target_positions
from onegpu.techniques.optimizer_in_backward import steps_in_backward
from onegpu.training import recovery


def train_step(
    model,
    optimizer,
    micro: list[dict],
    accelerator,
    max_grad_norm: float,
    objective: Objective | None = None,
    guard: recovery.NanGuard | None = None,
    step: int = 0,
    should_stop=None,
):
    """One optimizer step over k micro-batches.

    Each micro-batch contributes its *summed* loss divided by the objective's count of the whole
    accumulated batch (all processes: target tokens, or pairs for a preference objective), so the
    gradient equals that of one big batch however the tokens fall across micro-batches.
    ``objective`` defaults to SFT's plain loss. Returns (loss tensor, real input tokens) without
    syncing, except for the guard's one scalar: a NaN/inf loss or gradient norm skips the update.
    ``should_stop`` is polled between micro-batches; if it turns true the partial cycle is dropped
    (no update was made yet) and StepInterrupted is raised.
    """
    if objective is None:
        from onegpu.objectives.sft import plain

        objective = plain()
    in_backward = steps_in_backward(optimizer)
    micro = objective.begin_cycle(model, micro)  # statistics are kept per completed cycle
    micro = [
        with_target_positions(mb) for mb in micro
    ]  # on the host: the target rows, and so their count
    n_targets = _global_sum(accelerator, sum(objective.count(mb) for mb in micro))
    real_tokens = _global_sum(accelerator, sum(int(mb["attention_mask"].sum()) for mb in micro))
    total = None
    for i, mb in enumerate(micro):
        if i and should_stop is not None and should_stop():
            optimizer.zero_grad(set_to_none=True)
            raise recovery.StepInterrupted()
        mb = {k: v.to(accelerator.device, non_blocking=True) for k, v in mb.items()}
        with distributed.accumulating(accelerator, model, last=i == len(micro) - 1):
            loss = objective.loss(model, mb) / max(n_targets, 1)
            # Updates made inside backward cannot be skipped afterwards: a bad loss stops before it.
            if not (in_backward and guard is not None and not bool(loss.detach().isfinite())):
                distributed.backward(accelerator, loss)
        total = loss.detach() if total is None else total + loss.detach()
    total = distributed.global_loss(
        accelerator, total
    )  # the same value, and NaN verdict, on every rank
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
    objective.end_cycle()
    return total, real_tokens


def _global_sum(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return value
    import torch

    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum"))
