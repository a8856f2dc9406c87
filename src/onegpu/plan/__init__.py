"""The planner: predict whether a training setup fits on a GPU and how fast it runs, before running.

arch.py (model shapes on the meta device), activations.py (measuring activation bytes),
activation_model.py (the fitted byte formulas per block, checkpointing mode and compile),
memory.py (peak memory by component), speed.py (FLOPs over calibrated peak), search.py (candidate
setups, ranked), context.py (the longest sequence each setup fits), probe.py (a few real steps of
the best candidates; `train --plan auto`).
"""

from __future__ import annotations


def make_plan(
    cfg,
    model: str | None = None,
    gpu: str | None = None,
    seq_len: int | None = None,
    batch: int | None = None,
    memory_gib: float | None = None,
    images=None,
):
    """Plan for a config (optionally overriding model, GPU, length and batch; ``images``: a
    vision-language model's images per row, plan/vision.ImageLoad).

    Returns (Plan, recommended Config or None when nothing fits).
    """
    from onegpu.errors import ConfigError
    from onegpu.plan.search import search

    spec, name, shape, attention = resolve(cfg, model, gpu)
    seq_len = seq_len or cfg.data.seq_len
    batch = batch or cfg.training.micro_batch_size * cfg.training.grad_accum
    if seq_len < 1 or batch < 1:
        raise ConfigError(
            f"--data.seq_len and --batch must be positive, got {seq_len} and {batch}."
        )
    if shape.max_positions and seq_len > shape.max_positions:
        raise ConfigError(
            f"seq_len={seq_len} exceeds {name}'s max_position_embeddings={shape.max_positions}.",
            hint=f"use --data.seq_len <= {shape.max_positions}",
        )
    plan = search(cfg, spec, shape, seq_len, batch, memory_gib, attention, images=images)
    if plan.best is None:
        return plan, None
    from onegpu.hyper import resolve_hyperparameters

    rec = plan.best.candidate.apply(cfg)
    rec.model.name, rec.data.seq_len = name, seq_len
    return plan, resolve_hyperparameters(
        rec, name
    )  # the YAML shows the numbers a run would train with


def resolve(cfg, model: str | None = None, gpu: str | None = None):
    """(GPU spec, model name, ModelShape, attention kernel planned for) of a config and
    overrides."""
    from onegpu import hardware, models
    from onegpu.plan.arch import cached_shape
    from onegpu.techniques.attention import planning_attention

    spec = hardware.find_gpu(gpu) if gpu else hardware.spec_from_device(hardware.detect())
    name = model or models.resolve_name(cfg.model, spec.key != "CPU")
    score = cfg.training.objective == "reward"  # a reward model holds no LM head
    shape = cached_shape(name, cfg.model.vocab_size, cfg.model.trust_remote_code, score)
    attention = planning_attention(cfg.techniques, shape.config, cfg.model.trust_remote_code)
    return spec, name, shape, attention
