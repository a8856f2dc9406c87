"""FP8 training with torchao.float8: each chosen Linear layer becomes torchao's ``Float8Linear``,
whose three matmuls (output, input gradient, weight gradient) take float8 operands scaled on the
fly (dynamic scaling) and write the layer's own dtype.

What stays as it was: the parameters (same tensors, dtype and state_dict keys, so optimizers,
``save_pretrained`` and resume see an ordinary model and a checkpoint loads anywhere), every
other op, and the layers the rule leaves out:
- the output head: its logits carry the loss, and the fused loss multiplies it chunk by chunk;
- a Linear whose input or output dimension is not a multiple of 16 (the FP8 tensor cores' shape
  rule; torchao's own filter, ``_auto_filter_for_recipe``, applies the same one);
- LoRA's adapters (rank-r matmuls are far too small to gain) and layers that are not plain
  ``nn.Linear`` (a bitsandbytes base, MoE experts kept as one fused tensor);
- the names in ``techniques.fp8_skip``: where the planner's per-layer estimate says a layer's
  float8 matmuls would be slower than bf16 (plan/fp8.py), it writes the layer there.

Recipes (torchao's ``Float8LinearRecipeName``): tensorwise (one scale per tensor; cuBLAS's kernel,
the fastest), rowwise (a scale per row of each operand), rowwise-gw-hp (rowwise, with the weight
gradient's matmul in high precision). ``techniques.fp8_emulate`` keeps the casts and scales and
multiplies in high precision: FP8's numerics where no FP8 tensor core is (a CPU), for checking.

torchao's ``Float8Linear`` casts its input to the autocast dtype only when CUDA's autocast is on
("for now, hardcode to GPU's autocast dtype"): the layers here read the autocast state of the
input's own device, so a CPU (tests, the planner's measuring model) keeps what a card keeps.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from onegpu.config import TechniquesConfig
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

# techniques.fp8 -> torchao's Float8LinearRecipeName value
RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise-gw-hp": "rowwise_with_gw_hp"}
TC_MULTIPLE = 16  # both dimensions of an FP8 tensor-core matmul operand


def enabled(tcfg: TechniquesConfig) -> bool:
    """Whether this settled config trains in FP8 (auto must have been settled: resolve_fp8)."""
    return tcfg.fp8 in RECIPES


def resolve_fp8(tcfg: TechniquesConfig, device_type: str) -> str:
    """techniques.fp8 for a run: auto is the planner's to decide, so a run it did not plan trains
    without FP8."""
    fp8 = tcfg.fp8
    if fp8 == "auto":
        fp8 = "off"
        if device_type == "cuda":
            log.info(
                "techniques.fp8=auto: training without FP8 (the planner decides it: onegpu plan, "
                "train --plan auto; or set techniques.fp8=tensorwise)"
            )
    ignored = [k for k, v in (("fp8_skip", tcfg.fp8_skip), ("fp8_emulate", tcfg.fp8_emulate)) if v]
    if fp8 == "off" and ignored:
        log.warning("%s ignored: FP8 is off (techniques.fp8=%s)", " and ".join(ignored), tcfg.fp8)
    return fp8


def check_device(tcfg: TechniquesConfig, device) -> None:
    """One clear error where FP8 is asked for on a device without FP8 tensor cores."""
    if not enabled(tcfg) or tcfg.fp8_emulate or device.fp8:
        return
    cap = ".".join(map(str, device.capability)) if device.capability else None
    what = f"{device.name} (compute capability {cap})" if cap else device.name
    raise UnavailableError(
        f"techniques.fp8={tcfg.fp8}: {what} has no FP8 tensor cores; float8 matmuls need an "
        "Ada (capability 8.9: L4, L40S, RTX 4090) or Hopper (9.0: H100, H200) or newer GPU.",
        hint="train in bf16 on this device (techniques.fp8=off; precision=bf16 where it has bf16), "
        "or add techniques.fp8_emulate=true to check FP8's numerics here (no speed gain)",
    )


def _float8():
    """torchao.float8, or one error saying what to install."""
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise UnavailableError(
            f"techniques.fp8 needs torchao's float8 training API ({exc}).",
            hint="pip install 'onegpu[torchao]' (torchao >= 0.10), or set techniques.fp8=off",
        ) from None
    return float8, Float8Linear


def float8_config(recipe: str, emulate: bool = False):
    """torchao's Float8LinearConfig for a techniques.fp8 recipe."""
    float8, _ = _float8()
    config = float8.Float8LinearConfig.from_recipe_name(RECIPES[recipe])
    return dataclasses.replace(config, emulate=emulate)


_CLASS: list = []  # the device-aware Float8Linear, made once (it subclasses torchao's)


def float8_class() -> type:
    """``Float8Linear`` that casts its input to the autocast dtype of the input's device (torchao's
    casts only under CUDA autocast: see the module docstring). The class of every layer swapped
    here; the same code in every block, as regional compile needs."""
    if not _CLASS:
        _, base = _float8()

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            # CUDA's autocast is torchao's own case; meta (the planner's traces) has none
            if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
                input = input.to(torch.get_autocast_dtype("cpu"))
            return base.forward(self, input)

        _CLASS.append(type("Float8Linear", (base,), {"forward": forward, "__module__": __name__}))
    return _CLASS[0]


def skip_names(tcfg: TechniquesConfig) -> set[str]:
    return {n.strip() for n in tcfg.fp8_skip.split(",") if n.strip()}


def rule(module, fqn: str, head, skip: set[str]) -> str | None:
    """Why the rule keeps this module in high precision; None: it may run in float8."""
    if type(module) is not torch.nn.Linear:
        return "not a plain Linear"
    if module is head:
        return "the output head"
    if "lora_" in fqn:
        return "a LoRA adapter"
    out_f, in_f = module.weight.shape
    if in_f % TC_MULTIPLE or out_f % TC_MULTIPLE:
        return f"{in_f}x{out_f} is not a multiple of {TC_MULTIPLE}"
    if fqn in skip or fqn.rsplit(".", 1)[-1] in skip:
        return "techniques.fp8_skip"
    return None


def apply_fp8(model, tcfg: TechniquesConfig, device_type: str = "cuda"):
    """Swap the Linear layers the rule allows for float8 ones, in place; returns the model. Off
    (or an unsettled auto) changes nothing."""
    if not enabled(tcfg):
        return model
    float8, _ = _float8()
    # a transformers model names its output head; a bare module (a test's layer) has none
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = skip_names(tcfg)
    _check_skip_names(model, skip)
    kept: dict[str, int] = {}

    def keep(module, fqn: str) -> bool:
        why = rule(module, fqn, head, skip)
        if why is not None and isinstance(module, torch.nn.Linear):
            kept[why] = kept.get(why, 0) + 1
        return why is None

    float8.convert_to_float8_training(
        model, module_filter_fn=keep, config=float8_config(tcfg.fp8, tcfg.fp8_emulate)
    )
    swapped = float8_layers(model)
    cls = float8_class()
    for module in swapped:
        module.__class__ = cls
    log.info(
        "fp8 %s%s: %d Linear layers in float8; kept in high precision: %s",
        tcfg.fp8,
        " (emulated)" if tcfg.fp8_emulate else "",
        len(swapped),
        ", ".join(f"{why} ({n})" for why, n in kept.items()) or "none",
    )
    if not swapped:
        log.warning("techniques.fp8=%s: no Linear layer of this model can run in float8", tcfg.fp8)
    if device_type == "cpu" and not tcfg.fp8_emulate:
        log.warning("techniques.fp8 on CPU without fp8_emulate: torch's CPU float8 matmul is slow")
    return model


def float8_layers(model) -> list:
    """The model's float8 Linear layers."""
    _, base = _float8()
    return [m for m in model.modules() if isinstance(m, base)]


def _check_skip_names(model, skip: set[str]) -> None:
    """A techniques.fp8_skip name that matches no Linear layer is an error, not a silent no-op."""
    if not skip:
        return
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [s for s in sorted(skip) if not any(n == s or n.endswith("." + s) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(
            f"techniques.fp8_skip: {', '.join(missing)} matches no Linear layer of this model.",
            hint=f"use names from: {', '.join(short)}",
        )
