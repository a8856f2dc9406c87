"""Activation memory, measured: the bytes a forward pass leaves alive for backward.

We run the real model code on CPU at the real widths but tiny batch/length, with a 1-layer and a
2-layer copy of the architecture, and count the tensor storages created during forward that are
still alive once it returns (saved for backward, or held by checkpointing). The difference of the
two copies is one decoder block, the rest is embedding + head + loss. Each is fitted as
``b * (a*s + q*s^2) + c`` over a few small (b, s) points and scaled to the real batch, length and
layer count. Matmul outputs are allocated but not computed (see _SkipMatmul), so even 70B-wide
blocks measure in seconds; weights come from ``to_empty`` and are never written.

Compile is modelled from the same forward (``_Tracker.compiled_alive``): torch.compile's min-cut
partitioner saves the outputs of compute-heavy ops (matmuls, attention, reductions) and the inputs
of matmuls and attention, and recomputes other elementwise results, casts and copies in backward, so
a compiled block keeps, instead of such an intermediate, what it is recomputed from. An assumption,
not a measurement of compiled code: plan/published.py gives its source and check.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
from dataclasses import asdict, astuple

from onegpu.paths import cache_dir
from onegpu.plan.activation_model import ActivationModel, Fit
from onegpu.plan.saved_tensors import _Tracker  # noqa: F401 - measured here, re-exported for tests

log = logging.getLogger(__name__)

POINTS = (
    (1, 16),
    (1, 48),
    (1, 96),
    (2, 32),
    (2, 64),
    (4, 24),
)  # (batch, length) probes for the fit


def retained_after_forward(
    model, batch: dict, loss_fn, autocast_dtype=None, skip_matmul: bool = False
) -> int:
    """Bytes of tensors created by ``loss_fn(model, batch)`` that are alive after it returns
    (weights, buffers and the inputs excluded). Gradients are not computed."""
    return retained_eager_and_compiled(model, batch, loss_fn, autocast_dtype, skip_matmul)[0]


def retained_eager_and_compiled(
    model, batch: dict, loss_fn, autocast_dtype=None, skip_matmul: bool = False
) -> tuple[int, int]:
    """(retained_after_forward, what compiled code would keep of the same forward:
    compiled_alive)."""
    import torch

    exclude = {
        t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch.values()]
    }
    tracker = _Tracker(skip_matmul, frozenset(exclude))
    amp = (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with amp, tracker.mode:
        loss = loss_fn(model, batch)
    alive = tracker.alive(exclude), tracker.compiled_alive(exclude)
    del loss
    return alive


def prepare_like_training(
    model,
    mode: str = "off",
    every: int = 2,
    lora_rank: int = 0,
    lora_targets: str = "all-linear",
    lora_dtype: str = "auto",
    fp8: str = "off",
    fp8_skip: str = "",
    vision: str = "frozen",
):
    """Training's own assembly (training/assemble.assemble, and so techniques/prepare.py) of a built
    model, with the settings that change what forward keeps: MoE router loss, LoRA adapters, FP8's
    float8 layers (emulated: the same casts, and what they save, as on a card), checkpointing.
    Compile stays off: on CPU with matmuls skipped it would measure nothing real. No optimizer and
    no accelerator: only a forward is measured."""
    import logging

    from onegpu.config import Config, LoraConfig, TechniquesConfig
    from onegpu.hardware import DeviceInfo
    from onegpu.techniques.moe import use_experts_kernel
    from onegpu.training.assemble import assemble

    cfg = Config(
        techniques=TechniquesConfig(
            checkpointing=mode,
            checkpointing_every=every,
            compile="off",
            lora=LoraConfig(
                enabled=bool(lora_rank), r=lora_rank or 16, targets=lora_targets, dtype=lora_dtype
            ),
            fp8=fp8,
            fp8_skip=fp8_skip,
            fp8_emulate=True,
            vision=vision,  # what of a vision-language model trains (plan/vision.py)
        )
    )
    cpu = DeviceInfo("cpu", "cpu", 0)
    quiet = logging.getLogger("onegpu")  # its start-of-run lines mean nothing for a measuring model
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        model = assemble(cfg, cpu, "fp32", model, optimizer=False).model
    finally:
        quiet.setLevel(level)
    # MoE: the experts kernel of the GPU run being planned, not this CPU copy's (techniques/moe.py)
    use_experts_kernel(model, "cuda")
    return model


def activation_model(config, techniques=None, attention: str = "sdpa") -> ActivationModel:
    """Measured activation model for an architecture (cached on disk by config and settings) under a
    setup's settled TechniquesConfig (default: fp32, no adapters, the plain loss). Only what changes
    what forward keeps is read: precision, the LoRA adapters, the fused loss's chunk and FP8's
    float8 layers."""
    import dataclasses

    from onegpu.config import TechniquesConfig

    t = techniques or TechniquesConfig(precision="fp32", compile="off", loss="plain")
    if t.fp8 == "rowwise-gw-hp":
        # Eager, every recipe keeps the same (the layer input in high precision, the weight); but
        # here the weight gradient's matmul reads that input in high precision, so compiled code
        # must keep it as it keeps a plain Linear's input (measured on CPU with the card's
        # kernel: the compiled block of the plain model and of this recipe kept the same bytes).
        fp8 = activation_model(config, dataclasses.replace(t, fp8="rowwise"), attention)
        plain = activation_model(config, dataclasses.replace(t, fp8="off"), attention)
        return dataclasses.replace(fp8, block_compiled=plain.block_compiled)
    key = _cache_key(config, attention, *measured_settings(t))
    path = cache_dir() / "activations" / f"{key}.json"
    if path.is_file():
        raw = json.loads(path.read_text())
        return ActivationModel(**{k: Fit(**v) for k, v in raw.items()})
    fits = {mode: [_fit(config, n, mode, t, attention) for n in (1, 2)] for mode in ("off", "full")}
    ((off1, comp1), (off2, comp2)), ((ck1, _), (ck2, _)) = fits["off"], fits["full"]
    model = ActivationModel(
        block=_sub(off2, off1),
        block_ckpt=_sub(ck2, ck1),
        base=_sub(_scale(off1, 2), off2),
        block_compiled=_sub(comp2, comp1),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: asdict(v) for k, v in vars(model).items()}))
    return model


def measured_settings(t) -> tuple[str, int, int, str, str, str, str]:
    """(activation precision, LoRA rank, fused-loss chunk, LoRA targets, settled adapter dtype,
    FP8 recipe, FP8's skipped layers) of a TechniquesConfig: the settings an activation model is
    measured under. fp16 keeps the same bytes as bf16; without adapters their targets and dtype do
    not matter; tensorwise and rowwise float8 layers keep the same tensors (their inputs and
    weights in high precision: the casts are made again in backward), so both measure as one."""
    from onegpu.techniques.fp8 import enabled
    from onegpu.techniques.lora import adapter_dtype

    precision = "bf16" if t.precision == "fp16" else t.precision
    fp8 = ("tensorwise", t.fp8_skip) if enabled(t) else ("off", "")
    if not t.lora.enabled:
        return precision, 0, t.loss_chunk_size, "all-linear", "fp32", *fp8
    return (
        precision,
        t.lora.r,
        t.loss_chunk_size,
        t.lora.targets,
        adapter_dtype(t.lora.dtype, t.precision),
        *fp8,
    )


def _fit(config, layers: int, mode: str, techniques, attention: str) -> tuple[Fit, Fit]:
    """(eager fit, compiled fit) of the retained bytes over the (batch, length) points, for a model
    with ``layers`` blocks checkpointed per ``mode``."""
    import numpy as np

    precision, rank, chunk, targets, lora_dtype, fp8, skip = measured_settings(techniques)
    model = build_probe_model(
        config, layers, precision, rank, attention, mode, targets, lora_dtype, fp8, skip
    )
    rows, ys = [], []
    for b, s in POINTS:
        rows.append([b * s, b * s * s, b, s, 1.0])
        ys.append(measure(model, b, s, precision, chunk, skip_matmul=True, both=True))
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys, dtype=float), rcond=None)
    return Fit(*map(float, coef[:, 0])), Fit(*map(float, coef[:, 1]))


def measure(
    model,
    batch: int,
    seq: int,
    precision: str,
    chunk_size: int = 0,
    skip_matmul: bool = False,
    both: bool = False,
):
    """Retained bytes of one training forward (the project's loss function) at (batch, seq);
    with ``both``, (eager, compiled) bytes (see retained_eager_and_compiled)."""
    import functools

    import torch

    from onegpu.objectives.sft import loss_sum

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    amp = torch.bfloat16 if precision in ("fp16", "bf16") else None
    # The fused head's one check by value against the model's logits is skipped: the measuring
    # models' weights are uninitialised and their matmuls skipped, so only shapes mean anything.
    out = retained_eager_and_compiled(
        model,
        data,
        functools.partial(loss_sum, chunk_size=chunk_size, verify=False),
        amp,
        skip_matmul,
    )
    return out if both else out[0]


def build_probe_model(
    config,
    layers: int,
    precision: str = "fp32",
    lora_rank: int = 0,
    attention: str = "sdpa",
    mode: str = "off",
    lora_targets: str = "all-linear",
    lora_dtype: str = "fp32",
    fp8: str = "off",
    fp8_skip: str = "",
):
    """The architecture with ``layers`` decoder layers at full width, on CPU, weights uninitialised,
    prepared as training prepares it."""
    import torch
    from transformers import AutoModelForCausalLM

    from onegpu.plan.arch import language_config

    # a vision-language model: its language model's activations per token (image tokens included);
    # the vision tower's own are measured apart (plan/vision.py)
    cfg = copy.deepcopy(language_config(config))
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attention)
    model = model.to_empty(device="cpu")  # never written: untouched pages cost no RAM
    model.train()
    from onegpu.plan.moe_probe import route_round_robin

    model = prepare_like_training(
        model, mode, 2, lora_rank, lora_targets, lora_dtype, fp8, fp8_skip
    )
    route_round_robin(model)  # MoE: the same experts, all of them, at every point (moe_probe.py)
    return model


def _sub(a: Fit, b: Fit) -> Fit:
    return Fit(*(x - y for x, y in zip(astuple(a), astuple(b), strict=True)))


def _scale(a: Fit, k: float) -> Fit:
    return Fit(*(x * k for x in astuple(a)))


def _cache_key(
    config, attention, precision, lora_rank, chunk_size, lora_targets, lora_dtype, fp8, fp8_skip
) -> str:
    text = (
        config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    )
    import torch
    import transformers

    parts = [
        text,
        precision,
        str(lora_rank),
        str(chunk_size),
        attention,
        lora_targets,
        lora_dtype,
        *((fp8, fp8_skip) if fp8 != "off" else ()),  # keys made before FP8 stay valid
        "compiled-v2",
        repr(POINTS),
        "experts-round-robin-v1",  # MoE probes: fixed routing, the GPU run's experts kernel
        torch.__version__,
        transformers.__version__,
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
