"""Predicted against measured on a CUDA GPU: the numbers behind benchmarks/plan_accuracy.py and
tests/gpu/test_gpu_plan.py. Random tokens; the model is prepared by training's own pipeline
(techniques/prepare.py) and stepped by training's own train_step, so what is measured here is
what a training run does."""

from __future__ import annotations

import time

from onegpu.errors import UnavailableError
from onegpu.plan.candidate import Candidate


def _require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise UnavailableError("measuring the planner's accuracy needs a CUDA GPU.",
                               hint="run this on a GPU machine; on CPU use tests/test_plan_memory.py")


def run_config(c: Candidate):
    """The training Config of a setup (what `train` would run for this candidate)."""
    from onegpu.config import Config

    return c.apply(Config())


def build(config, c: Candidate):
    """Model (prepared by training's pipeline), optimizer, loss function and accelerator for a setup.
    Full or LoRA fine-tuning; quantized bases and DeepSpeed offload are measured through
    `train --plan auto` instead."""
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.hardware import detect
    from onegpu.techniques.attention import model_kernels, resolve_attention
    from onegpu.techniques.loss import LossFn
    from onegpu.techniques.optimizers import build_optimizer
    from onegpu.techniques.prepare import prepare_model
    from onegpu.techniques.precision import weights_dtype
    from onegpu.training.assemble import make_accelerator

    cfg = run_config(c)
    device = detect()
    precision = c.techniques.precision
    accelerator = make_accelerator(cfg, device, precision)
    torch.manual_seed(0)
    attention = resolve_attention(cfg.techniques, device, precision, model_kernels(config))
    model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(precision),
                                             attn_implementation=attention)
    model = prepare_model(model.to(accelerator.device).train(), cfg.techniques, device.type)
    optimizer = build_optimizer(model, cfg.techniques, cfg.training)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, LossFn(c.techniques.loss_chunk_size), accelerator


def _batch(vocab: int, batch: int, seq: int):
    import torch

    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def retained_bytes(config, c: Candidate, seq: int) -> int:
    """Device bytes a forward leaves allocated for backward (what ActivationModel.retained predicts)."""
    import torch

    _require_cuda()
    model, _, loss_fn, accelerator = build(config, c)
    rows = c.training.micro_batch_size
    data = {k: v.cuda() for k, v in _batch(config.vocab_size, rows, seq).items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = loss_fn(model, data)  # the prepared model autocasts itself, as in training
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - loss.numel() * loss.element_size()
    del loss, model
    torch.cuda.empty_cache()
    return kept


def step_peak(config, c: Candidate, seq: int, steps: int = 3) -> dict:
    """Steady-state peak allocated bytes and tokens/s over ``steps`` optimizer steps (after one warm-up)."""
    import torch

    from onegpu.training.step import train_step

    _require_cuda()
    model, opt, loss_fn, accelerator = build(config, c)
    max_grad_norm = run_config(c).training.max_grad_norm
    rows = c.training.micro_batch_size
    micro = [_batch(config.vocab_size, rows, seq) for _ in range(c.training.grad_accum)]
    t0 = 0.0
    for step in range(steps + 1):
        if step == 1:  # optimizer state exists from here on, as in every later step
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        train_step(model, opt, micro, accelerator, max_grad_norm, loss_fn)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out = {"peak_bytes": torch.cuda.max_memory_allocated(),
           "tokens_per_s": steps * c.effective_batch * seq / elapsed}
    del model, opt
    torch.cuda.empty_cache()
    return out
