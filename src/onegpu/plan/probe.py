"""`onegpu train --plan auto`: plan, then run the best few setups for a few steps on this device,
keep the fastest that really fits, store the measured efficiency as calibration, and train with it.

A probe builds the data once and, per setup, the model, objective and optimizer through training's
one assembly (training/assemble.assemble, and so its one pipeline, techniques/prepare.py) and steps
them with train_step, so what it measures is what training will do.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from onegpu.config import Config

log = logging.getLogger(__name__)

TOP = 3  # setups probed
WARMUP_STEPS = (
    2  # allocator growth, optimizer state, compile (and a recompile for the second shape)
)
MEASURE_STEPS = 6  # enough steps that one slow step does not set the calibration


@dataclass
class Measured:
    label: str
    predicted_tokens_per_s: float
    predicted_peak_gb: float
    tokens_per_s: float = 0.0
    peak_gb: float = 0.0
    error: str = ""


def auto_plan(cfg: Config) -> Config:
    """Return cfg rewritten to the fastest measured setup (the effective batch unchanged)."""
    from onegpu import hardware, models
    from onegpu.errors import OnegpuError
    from onegpu.plan.arch import model_shape
    from onegpu.plan.search import search
    from onegpu.techniques.attention import planning_attention

    device = hardware.detect()
    spec = _device_spec(device)
    name = models.resolve_name(cfg.model, device.is_gpu)
    shared = _shared_data(cfg, device, name)
    vocab = len(shared.tokenizer) if models.is_preset(name) else cfg.model.vocab_size
    score = cfg.training.objective == "reward"  # a reward model holds no LM head
    shape = model_shape(name, vocab, cfg.model.trust_remote_code, score)
    batch = cfg.training.micro_batch_size * cfg.training.grad_accum
    attention = planning_attention(cfg.techniques, shape.config, cfg.model.trust_remote_code)
    plan = search(cfg, spec, shape, cfg.data.seq_len, batch, device.total_memory / 2**30, attention)
    rows = [r for r in plan.rows if r.fits][:TOP]
    if not rows:
        raise OnegpuError(
            f"the planner finds no setup of {name} that fits in {device.total_memory / 2**30:.1f} "
            f"GB at seq_len={cfg.data.seq_len}, batch={batch}.",
            hint="run 'onegpu plan' to see what each setup needs; shorten data.seq_len",
        )
    # The first setup probed in a process pays one-off start-up costs that its own warm-up steps do
    # not absorb (measured: ~4x slower on a CPU); one untimed pass keeps them out of every probe.
    probe_one(rows[0], cfg, shared, device)
    results = [probe_one(r, cfg, shared, device) for r in rows]
    _log_table(results)
    ok = [(m, r) for m, r in zip(results, rows, strict=True) if not m.error]
    if not ok:
        log.warning(
            "plan: every probe failed; training with the first prediction, %s",
            rows[0].candidate.label(),
        )
        return rows[0].candidate.apply(cfg)
    best_m, best_r = max(ok, key=lambda mr: mr[0].tokens_per_s)
    _calibrate(spec, best_r, best_m, cfg.data.seq_len, shape, cfg.techniques.tf32 is not False)
    log.info("plan: training with %s (%.0f tokens/s measured)", best_m.label, best_m.tokens_per_s)
    return best_r.candidate.apply(cfg)


def _device_spec(device):
    """The catalog entry, or for an uncatalogued GPU the closest card of its generation with this
    device's memory: the probe measures the real speed anyway, the prediction only ranks."""
    import dataclasses

    from onegpu import hardware
    from onegpu.errors import UnavailableError

    try:
        return hardware.spec_from_device(device)
    except UnavailableError:
        same_gen = [
            g for g in hardware.CATALOG if g.capability <= (device.capability or (0, 0))
        ] or list(hardware.CATALOG)
        near = max(same_gen, key=lambda g: g.capability)
        log.warning(
            "plan: %s is not in the GPU catalog; ranking with %s's peak figures until the probe "
            "measures it",
            device.name,
            near.key,
        )
        return dataclasses.replace(
            near, key=device.name, name=device.name, memory_gib=device.total_memory / 2**30
        )


def _shared_data(cfg: Config, device, name: str):
    """Tokenizer, datasets and collator, built once for all probes (they do not depend on the
    setup)."""
    from onegpu.training.data import build_data

    return build_data(cfg, name)


def probe_one(row, cfg: Config, shared, device) -> Measured:
    """Run WARMUP_STEPS + MEASURE_STEPS optimizer steps of one setup; tokens/s and peak memory."""
    import torch

    from onegpu.hyper import resolve_hyperparameters
    from onegpu.models import resolve_name
    from onegpu.techniques.prepare import global_switches

    m = Measured(row.candidate.label(), row.speed.tokens_per_s, row.memory.peak / 2**30)
    # Settled per candidate, as run_training settles a run: a LoRA candidate gets LoRA's auto
    # values.
    name = resolve_name(cfg.model, device.is_gpu)
    setup = resolve_hyperparameters(row.candidate.apply(cfg), name)
    try:
        with global_switches(setup, device):  # as training sets them, and put back after
            m.tokens_per_s, m.peak_gb = _run_steps(setup, shared, device)
    except torch.OutOfMemoryError:
        m.error = "out of memory"
    except Exception as exc:  # a method unavailable here: skip this setup, keep probing the others
        m.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:120]
    finally:
        _release(device)
    return m


def _run_steps(cfg: Config, shared, device) -> tuple[float, float]:
    """(tokens/s, peak GB) of one setup; ``shared``: the data (training/data.Data), built once."""
    import torch
    from accelerate.utils import set_seed

    from onegpu.data import batches
    from onegpu.models import resolve_name
    from onegpu.techniques.precision import resolve_precision
    from onegpu.training import assemble
    from onegpu.training.step import train_step

    precision = resolve_precision(cfg.techniques, device)
    accelerator = assemble.make_accelerator(cfg, device, precision)
    set_seed(cfg.training.seed)
    rss_before = _rss()
    # as training assembles it; a precomputed DPO reference is timed with fixed log-probs (probe)
    name = resolve_name(cfg.model, device.is_gpu)
    parts = assemble.assemble(
        cfg,
        device,
        precision,
        name,
        tokenizer=shared.tokenizer,
        accelerator=accelerator,
        probe=True,
    )
    model, optimizer = parts.model, parts.optimizer
    t = cfg.training
    # as training draws them (GRPO: whole groups per step, its sampling timed)
    order = batches.training_order(cfg, len(shared.train_ds), t.micro_batch_size, t.grad_accum)
    loader = iter(
        batches.make_loader(shared.train_ds, order, shared.collator, cfg.data, device.is_gpu)
    )
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens, t0 = 0, 0.0
    for step in range(WARMUP_STEPS + MEASURE_STEPS):
        if step == WARMUP_STEPS:
            _sync(device)
            tokens, t0 = 0, time.perf_counter()
        micro = [next(loader) for _ in range(t.grad_accum)]
        loss, real = train_step(
            model, optimizer, micro, accelerator, t.max_grad_norm, parts.objective
        )
        tokens += real
    float(loss)  # wait for the device
    elapsed = time.perf_counter() - t0
    return tokens / max(elapsed, 1e-9), _peak_gb(device, rss_before)


def _peak_gb(device, rss_before: int) -> float:
    """CUDA: the allocator's peak. CPU: how much the process's resident memory grew since just
    before the model was built (coarse: the host allocator keeps freed pages)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return max(0, _rss() - rss_before) / 2**30


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return 0


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _release(device) -> None:
    """Free the probe's model and optimizer (the next probe's make_accelerator starts Accelerate
    afresh)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _calibrate(spec, row, measured: Measured, seq_len: int, shape, tf32: bool = True) -> None:
    """Store the efficiency that makes the speed model reproduce this measurement (compute only,
    saturated: see plan/speed.py), for later plans."""
    from onegpu.plan import speed

    c = row.candidate
    eff = speed.compute_efficiency(shape, c, seq_len, spec, measured.tokens_per_s, tf32)
    precision = c.techniques.precision
    speed.save_calibration(spec.key, precision, eff, c.training.micro_batch_size * seq_len)
    log.info("plan: calibrated %s %s compute efficiency %.3f", spec.key, precision, eff)


def _log_table(results: list[Measured]) -> None:
    log.info("plan: probed setups, predicted vs measured")
    log.info(f"  {'setup':<44} {'pred tok/s':>12} {'meas tok/s':>12} {'pred GB':>8} {'meas GB':>8}")
    for m in results:
        meas = f"{m.tokens_per_s:>12,.0f} {m.predicted_peak_gb:>8.2f} {m.peak_gb:>8.2f}"
        log.info(
            f"  {m.label:<44} {m.predicted_tokens_per_s:>12,.0f} "
            + (meas if not m.error else f"failed: {m.error}")
        )
