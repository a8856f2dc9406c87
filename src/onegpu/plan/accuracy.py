"""Predicted against measured on a CUDA GPU: the numbers behind benchmarks/plan_accuracy.py and
tests/gpu/test_gpu_plan.py. Random tokens, the project's model preparation, optimizer and loss."""

from __future__ import annotations

import contextlib
import functools
import time

from onegpu.errors import UnavailableError
from onegpu.plan.candidate import Candidate


def _require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise UnavailableError("measuring the planner's accuracy needs a CUDA GPU.",
                               hint="run this on a GPU machine; on CPU use tests/test_plan_memory.py")


def build(config, c: Candidate):
    """Model (prepared like training) and optimizer for a setup, on the GPU. Full or LoRA fine-tuning;
    quantized bases and DeepSpeed offload are measured through `train --plan auto` instead."""
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.config import LoraConfig, TechniquesConfig, TrainingConfig
    from onegpu.hardware import detect
    from onegpu.techniques import prepare_model
    from onegpu.techniques.optimizers import build_optimizer
    from onegpu.techniques.precision import weights_dtype

    _require_cuda()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=weights_dtype(c.precision), attn_implementation="sdpa")
    model = model.cuda().train()
    tcfg = TechniquesConfig(precision=c.precision, checkpointing=c.checkpointing, checkpointing_every=c.every,
                            optimizer=c.optimizer, loss="fused" if c.loss_chunk else "plain",
                            loss_chunk_size=c.loss_chunk, compile=c.compile,
                            lora=LoraConfig(enabled=bool(c.lora_rank), r=c.lora_rank or 16))
    model = prepare_model(model, tcfg, detect())
    return model, build_optimizer(model, tcfg, TrainingConfig())


def _batch(vocab: int, batch: int, seq: int):
    import torch

    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _autocast(precision: str):
    import torch

    if precision in ("bf16", "fp16"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def retained_bytes(config, c: Candidate, seq: int) -> int:
    """Device bytes a forward leaves allocated for backward (what ActivationModel.retained predicts)."""
    import torch

    from onegpu.techniques.loss import loss_sum

    model, _ = build(config, c)
    data = _batch(config.vocab_size, c.micro_batch, seq)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with _autocast(c.precision):
        loss = loss_sum(model, data, chunk_size=c.loss_chunk)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - loss.numel() * loss.element_size()
    del loss, model
    torch.cuda.empty_cache()
    return kept


def step_peak(config, c: Candidate, seq: int, steps: int = 3) -> dict:
    """Steady-state peak allocated bytes and tokens/s over ``steps`` optimizer steps (after one warm-up)."""
    import torch

    from onegpu.techniques.loss import loss_sum

    model, opt = build(config, c)
    loss_fn = functools.partial(loss_sum, chunk_size=c.loss_chunk)
    data = _batch(config.vocab_size, c.micro_batch, seq)
    t0 = 0.0
    for step in range(steps + 1):
        if step == 1:  # optimizer state exists from here on, as in every later step
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        for _ in range(c.grad_accum):
            with _autocast(c.precision):
                loss = loss_fn(model, data) / (c.micro_batch * seq)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out = {"peak_bytes": torch.cuda.max_memory_allocated(),
           "tokens_per_s": steps * c.effective_batch * seq / elapsed}
    del model, opt
    torch.cuda.empty_cache()
    return out
