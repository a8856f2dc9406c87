"""The `fp8` arm of `onegpu bench train`: the layers the planner keeps in float8.

The arm trains as `train --plan auto` would with FP8 on: torchao's tensorwise recipe on the layers
the planner keeps in float8 at this run's shape and card (plan/fp8.choose_skip; the rest go to
``techniques.fp8_skip``), compiled like every onegpu arm on a GPU (bench/settle.py). A device
without FP8 tensor cores skips it with the reason (FP8's numerics on a CPU:
benchmarks/results/fp8-cpu-20261128.md).
"""

from __future__ import annotations

RECIPE = "tensorwise"  # what the planner picks when FP8 is left to it (plan/search.fp8_recipes)


def fp8_card(dev, b, fmt) -> str | None:
    """Why the fp8 arm cannot run here (None: it can)."""
    if dev.fp8:
        return None
    return (
        f"FP8 training needs FP8 tensor cores (an Ada or Hopper GPU); {dev.name} has none "
        "(FP8's numerics on a CPU: benchmarks/results/fp8-cpu-20261128.md)"
    )


def _candidate(config, spec, fp8: str):
    """The run as a planner candidate with ``fp8`` set, its float8 layers chosen for ``spec``."""
    from onegpu import models
    from onegpu.config import from_dict, to_dict
    from onegpu.plan.arch import cached_shape
    from onegpu.plan.candidate import setup
    from onegpu.plan.search import with_fp8_layers
    from onegpu.techniques.fused_loss import fused_chunk

    cfg = config if not isinstance(config, dict) else from_dict(config)
    cfg = from_dict({k: v for k, v in to_dict(cfg).items() if k != "bench"})
    name = models.resolve_name(cfg.model, True)
    shape = cached_shape(name, cfg.model.vocab_size, cfg.model.trust_remote_code)
    t, tr, seq = cfg.techniques, cfg.training, cfg.data.seq_len
    c = setup(
        tr.micro_batch_size,
        tr.grad_accum,
        cfg,
        precision="bf16" if t.precision == "auto" else t.precision,
        compile="default" if t.compile == "auto" else t.compile,
        loss_chunk_size=fused_chunk(t, shape.vocab, True, sharded=False),
        fp8=fp8,
        fp8_skip="",
    )
    return with_fp8_layers(c, shape, spec, seq, "")


def planned_overrides(b, device) -> dict:
    """The fp8 arm's settings on ``device``: the recipe, and the layers the planner keeps in bf16
    (none off a catalogued FP8 card, where the arm is skipped anyway)."""
    from onegpu import hardware
    from onegpu.errors import ModelError

    out = {"techniques.fp8": RECIPE}
    spec = hardware.match_device(device)
    if spec is None or not spec.fp8:
        return out
    try:
        c = _candidate(b, spec, RECIPE)
    except ModelError:  # a dry run lists the arms before the model is written: the rule's layers
        return out
    if c is not None and c.techniques.fp8_skip:
        out["techniques.fp8_skip"] = c.techniques.fp8_skip
    return out
