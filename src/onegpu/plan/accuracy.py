"""Predicted against measured on a CUDA GPU: the numbers behind tests/gpu/test_gpu_plan.py and
scripts/simgpu_vs_real.py. Random tokens; the model is prepared by training's own pipeline
(techniques/prepare.py) and stepped by training's own train_step, so what is measured here is
what a training run does."""

from __future__ import annotations

import time

from onegpu.errors import UnavailableError
from onegpu.plan.candidate import Candidate


def _require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise UnavailableError(
            "measuring the planner's accuracy needs a CUDA GPU.",
            hint="run this on a GPU machine; on CPU use tests/test_plan_memory.py",
        )


def run_config(c: Candidate):
    """The training Config of a setup (what `train` would run for this candidate), its `auto`
    hyper-parameters settled as a run settles them (a model from a config: the scratch values)."""
    from onegpu.config import Config
    from onegpu.hyper import resolve_hyperparameters

    return resolve_hyperparameters(c.apply(Config()))


def build(config, c: Candidate):
    """Model, optimizer, objective and accelerator for a setup, assembled as training assembles them
    (training/assemble.assemble) from a transformers config at random weights. Full or LoRA
    fine-tuning; quantized bases and DeepSpeed offload are measured through `train --plan auto`
    instead."""
    import torch

    from onegpu.hardware import detect
    from onegpu.training.assemble import assemble, make_accelerator

    cfg = run_config(c)
    device = detect()
    precision = c.techniques.precision
    accelerator = make_accelerator(cfg, device, precision)
    torch.manual_seed(0)
    parts = assemble(cfg, device, precision, config, accelerator=accelerator)
    return parts.model, parts.optimizer, parts.objective, accelerator


def _batch(vocab: int, batch: int, seq: int):
    import torch

    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def retained_bytes(config, c: Candidate, seq: int) -> int:
    """Device bytes a forward leaves allocated for backward (what ActivationModel.retained
    predicts)."""
    import torch

    from onegpu.objectives.tokens import with_target_positions

    _require_cuda()
    model, _, objective, accelerator = build(config, c)
    rows = c.training.micro_batch_size
    # the target rows found on the host, as train_step finds them, then the batch on the device
    batch = with_target_positions(_batch(config.vocab_size, rows, seq))
    data = {k: v.cuda() for k, v in batch.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = objective.loss(model, data)  # the prepared model autocasts itself
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - loss.numel() * loss.element_size()
    del loss, model
    _baseline()
    return kept


def step_peak(config, c: Candidate, seq: int, steps: int = 3) -> dict:
    """Steady-state peak allocated bytes and tokens/s over ``steps`` optimizer steps (after one
    warm-up)."""
    import torch

    from onegpu.training.step import train_step

    _require_cuda()
    base = _baseline()
    model, opt, objective, accelerator = build(config, c)
    max_grad_norm = run_config(c).training.max_grad_norm
    rows = c.training.micro_batch_size
    micro = [_batch(config.vocab_size, rows, seq) for _ in range(c.training.grad_accum)]
    t0 = 0.0
    for step in range(steps + 1):
        if step == 1:  # optimizer state exists from here on, as in every later step
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        train_step(model, opt, micro, accelerator, max_grad_norm, objective)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out = {
        "peak_bytes": torch.cuda.max_memory_allocated() - base,
        "tokens_per_s": steps * c.effective_batch * seq / elapsed,
    }
    del model, opt
    _baseline()
    return out


def _baseline() -> int:
    """What this process holds on the device before a setup is built: earlier setups' reference
    cycles collected first (del alone leaves them), then the bytes still allocated, which the
    setup's own peak leaves out."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()
