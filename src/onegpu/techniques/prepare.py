"""THE ordered pipeline from a configuration to a prepared model: the one place methods are
applied. Training, the planner's probes and measurements, and every benchmark arm call it.

The order, and why:
1. load-time arguments (weights dtype, attention kernel, quantized base): they can only be chosen
   when ``from_pretrained`` builds the model;
2. MoE router loss: a config switch on the loaded model, before anything wraps it; a
   vision-language model's frozen tower and projector (techniques.vision), on the plain module
   names, before adapters rename them;
3. LoRA / QLoRA: adapters replace the Linear layers that the later steps must see;
4. FP8: the Linear layers left to train or to carry adapters become float8 ones. After LoRA, so
   PEFT wraps plain Linear layers and its adapters, found by name inside the wrappers, stay in
   high precision (rank-r matmuls gain nothing in float8), while each adapted base layer still
   runs in float8; before tiled MLP, checkpointing and compile, which call, recompute and trace
   whatever layers the blocks hold by then (compile must see the float8 casts to fuse them);
5. tiled MLP: each MLP's forward runs over sequence tiles; after LoRA, whose adapted Linear
   layers the tiles must call, and before compile, so the compiled blocks hold the tiling;
6. checkpointing: wraps the final layers, before compile so the compiled graph holds the recompute
   (with FP8, a checkpointed block recomputes its float8 casts instead of keeping them);
7. compile: over the final module structure;
8. activation offload: saved-tensor hooks the outermost module enters for its forward, so they
   see what autograd saves wherever it is saved: inside compiled code, and with checkpointing
   the checkpointed blocks' inputs (the recompute inside a block saves through its own hooks);
9. FSDP2: shards the finished module tree, before the optimizer sees the parameters (the float8
   layers keep their parameters, so the optimizer and the step in backward see the same ones).
The optimizer comes last (``training.assemble.build_optimizer``; DeepSpeed offload brings its own).

Global switches (TF32, dynamo's error fallback) are process-wide, so they are set in one place,
``global_switches``, for the length of a run, and put back as they were afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from onegpu.config import Config, TechniquesConfig
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


def load_kwargs(cfg: Config, device: DeviceInfo, precision: str, model_name: str) -> dict:
    """Step 1: the arguments ``models.load_model`` passes to ``from_pretrained``. The attention
    kernel depends on what the model class supports, read from its config alone (no weights)."""
    from onegpu.models import model_config
    from onegpu.techniques.lora import quantization_config

    quant = quantization_config(cfg.techniques, precision, model_name, cfg.model)  # QLoRA base
    config = model_config(model_name, cfg.model.trust_remote_code)
    return {
        **build_kwargs(cfg, device, precision, config),
        "extra": {"quantization_config": quant} if quant else None,
    }


def build_kwargs(cfg: Config, device: DeviceInfo, precision: str, config) -> dict:
    """The weights' dtype and the attention kernel for a model of this transformers ``config``:
    what a load from a name and a build from a config (the planner's accuracy check) share."""
    from onegpu.techniques.attention import model_kernels, resolve_attention
    from onegpu.techniques.precision import weights_dtype

    kernels = model_kernels(config, cfg.model.trust_remote_code)
    return {
        "dtype": weights_dtype(precision),
        "attn_implementation": resolve_attention(cfg.techniques, device, precision, kernels),
    }


def prepare_model(
    model, tcfg: TechniquesConfig, device_type: str, shard=None, seq_len: int | None = None
):
    """Steps 2-9 on a loaded model. ``tcfg.compile`` must be settled (see ``resolved_techniques``);
    ``shard`` is the FSDP2 step (``distributed.apply_fsdp2`` bound to the run), None for one
    process; ``seq_len``: the run's longest sequence, for the start-up lines (None: not known)."""
    from onegpu.techniques.activation_offload import apply_activation_offload
    from onegpu.techniques.checkpointing import apply_checkpointing
    from onegpu.techniques.compile import apply_compile
    from onegpu.techniques.fp8 import apply_fp8
    from onegpu.techniques.lora import apply_lora
    from onegpu.techniques.moe import apply_moe_aux_loss
    from onegpu.techniques.tiled_mlp import apply_tiled_mlp
    from onegpu.techniques.vision import apply_vision

    apply_moe_aux_loss(model, device_type)
    model = apply_vision(model, tcfg)  # what of a vision-language model trains, before adapters
    model = apply_lora(model, tcfg)
    model = apply_fp8(model, tcfg, device_type)
    model = apply_tiled_mlp(model, tcfg, seq_len)
    model = apply_checkpointing(model, tcfg, device_type)
    model = apply_compile(model, tcfg, device_type)
    model = apply_activation_offload(model, tcfg, device_type)
    return shard(model) if shard is not None else model


def resolved_techniques(cfg: Config, device_type: str) -> TechniquesConfig:
    """cfg.techniques with compile=auto and fp8=auto settled for this run."""
    from onegpu.techniques.compile import resolve_compile
    from onegpu.techniques.fp8 import resolve_fp8

    return dataclasses.replace(
        cfg.techniques,
        compile=resolve_compile(cfg, device_type),
        fp8=resolve_fp8(cfg.techniques, device_type),
    )


@contextlib.contextmanager
def global_switches(cfg: Config, device: DeviceInfo):
    """Process-wide settings a run needs, restored on exit (a notebook or a benchmark may run
    several jobs in one process):
    - TF32 matmuls (``techniques.tf32``, default on for Ampere+ GPUs);
    - when compile=auto chose to compile, a compiler failure falls back to eager code with a
      warning (dynamo's ``suppress_errors``) instead of stopping the run.
    """
    import torch
    import torch._dynamo

    from onegpu.techniques.compile import auto_compiles
    from onegpu.techniques.precision import apply_tf32, set_tf32, tf32_state

    saved = (tf32_state(), torch._dynamo.config.suppress_errors)
    try:
        apply_tf32(cfg.techniques, device)
        if auto_compiles(cfg, device.type):
            torch._dynamo.config.suppress_errors = True
        yield
    finally:
        set_tf32(saved[0])
        torch._dynamo.config.suppress_errors = saved[1]
