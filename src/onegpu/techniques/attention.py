"""Attention kernel choice: eager, PyTorch SDPA, or FlashAttention, per model and device.

"auto" (the default) is the fastest kernel both the model class and the device support:
flash_attention_2 (the flash_attn package, CUDA, fp16/bf16), then SDPA, then eager. Support is read
from the class's own flags (``_supports_flash_attn``, ``_supports_sdpa``), found from the config
alone, so nothing is built to decide: Gemma-2 and gpt-oss, whose attention SDPA cannot express
(logit soft-capping, attention sinks), get eager instead of transformers' "does not support sdpa".
Under auto on a GPU without flash_attn, plain SDPA is chosen rather than our flash-only SDPA below:
SDPA already dispatches to its flash kernel wherever that kernel applies.

An explicit choice the model refuses is a ConfigError naming the model and what it supports.

"flash" means the flash_attn package (attn_implementation="flash_attention_2") when it is
installed and the model supports it, otherwise PyTorch SDPA restricted to its FlashAttention kernel,
with the memory-efficient kernel as the only fallback (for batches whose padding mask flash cannot
take). The restriction is an attention function registered with transformers' AttentionInterface,
so it applies exactly around each attention call, also under torch.compile and gradient
checkpointing recomputes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

from onegpu.config import TechniquesConfig
from onegpu.errors import ConfigError
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)

# No "flash" in the name on purpose: transformers treats any such name as a flash_attn package
# request.
SDPA_FLASH = "sdpa_fa_kernel"
FLASH2 = "flash_attention_2"
HALF_PRECISIONS = ("fp16", "bf16", "bf16-pure")


@dataclass(frozen=True)
class ModelKernels:
    """The attention kernels a model class supports, read from its class flags."""

    model_type: str
    class_name: str
    flash: bool  # flash_attn package kernels (flash_attention_2)
    sdpa: bool

    def supported(self) -> list[str]:
        return [k for k, ok in ((FLASH2, self.flash), ("sdpa", self.sdpa), ("eager", True)) if ok]

    def __str__(self) -> str:
        return f"{self.model_type} ({self.class_name})" if self.class_name else self.model_type


# A model whose class cannot be found (e.g. remote code not trusted yet): assumed to support every
# kernel, so its load reports transformers' own error if it does not.
ANY_MODEL = ModelKernels("model", "", flash=True, sdpa=True)


def model_kernels(config, trust_remote_code: bool = False) -> ModelKernels:
    """What the class AutoModelForCausalLM would build for ``config`` supports (no weights
    loaded)."""
    from onegpu.models import causal_lm_class

    cls = causal_lm_class(config, trust_remote_code)
    model_type = getattr(config, "model_type", "") or "model"
    if cls is None:
        return dataclasses.replace(ANY_MODEL, model_type=model_type)
    # _supports_flash_attn_2: the name older remote-code models still use.
    flash = bool(
        getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)
    )
    return ModelKernels(
        model_type, cls.__name__, flash=flash, sdpa=bool(getattr(cls, "_supports_sdpa", False))
    )


def resolve_attention(
    tcfg: TechniquesConfig,
    device: DeviceInfo,
    precision: str = "fp32",
    model: ModelKernels | None = None,
) -> str:
    """The attn_implementation to load a model for training with (``precision``: the resolved
    one)."""
    return attention_implementation(
        tcfg.attention, device.type, device.name, model, precision in HALF_PRECISIONS
    )


def planning_attention(tcfg: TechniquesConfig, config, trust_remote_code: bool = False) -> str:
    """The kernel the planner measures a model's activations with, on the CPU, by this resolution:
    auto and flash count as auto there (sdpa where the model has it, else eager), as flash kernels
    keep the tensors SDPA keeps; an explicit sdpa the model refuses is the same error as in
    training."""
    want = tcfg.attention if tcfg.attention in ("eager", "sdpa") else "auto"
    return attention_implementation(want, "cpu", model=model_kernels(config, trust_remote_code))


def attention_implementation(
    want: str,
    device_type: str,
    device_name: str = "",
    model: ModelKernels | None = None,
    half: bool = False,
) -> str:
    """The attn_implementation for a choice (auto / eager / sdpa / flash) on a device for a model
    (None: one that supports every kernel); ``half``: the model computes in fp16/bf16. The one
    resolution, used by training, inference and the planner alike."""
    model = model or ANY_MODEL
    if want == "auto":
        return _auto(model, device_type, half)
    if want == "flash":
        return _flash(model, device_type, device_name)
    if want == "sdpa" and not model.sdpa:
        raise _refused(want, model, device_type, half)
    return want


def _auto(model: ModelKernels, device_type: str, half: bool) -> str:
    choice, best = _fastest(model, device_type, half)
    if choice != best:
        log.info("attention=auto: %s does not support %s; using %s", model, best, choice)
    return choice


def _fastest(model: ModelKernels, device_type: str, half: bool) -> tuple[str, str]:
    """(the fastest kernel the model and device support, the fastest the device supports)."""
    fastest = ([FLASH2] if device_type == "cuda" and half and flash_attn_installed() else []) + [
        "sdpa",
        "eager",
    ]
    return next(k for k in fastest if k in model.supported()), fastest[0]


def _flash(model: ModelKernels, device_type: str, device_name: str) -> str:
    if device_type != "cuda":
        fallback = "sdpa" if model.sdpa else "eager"
        log.warning(
            "attention=flash needs a CUDA GPU; using %s on %s instead",
            fallback,
            device_name or device_type,
        )
        return fallback
    if model.flash and flash_attn_installed():
        return FLASH2
    if not model.sdpa:
        raise _refused("flash", model, device_type, True)
    register_sdpa_flash()
    why = (
        "flash_attn package not installed"
        if model.flash
        else f"{model} has no flash_attention_2 support"
    )
    log.info(
        "attention: SDPA with the FlashAttention kernel where it applies, else memory-efficient "
        "(%s)",
        why,
    )
    return SDPA_FLASH


def _refused(want: str, model: ModelKernels, device_type: str, half: bool) -> ConfigError:
    auto = _fastest(model, device_type, half)[0]
    fix = "install flash-attn, or use" if want == "flash" and model.flash else "use"
    return ConfigError(
        f"attention={want} is not supported by {model}; it supports "
        f"{', '.join(model.supported())}.",
        hint=f"{fix} attention=auto, which picks the fastest kernel the model supports ({auto} "
        "here)",
    )


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def register_sdpa_flash() -> str:
    """Register SDPA_FLASH with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_FLASH, _sdpa_flash_attention)
    AttentionMaskInterface.register(SDPA_FLASH, sdpa_mask)  # same masks as plain SDPA
    return SDPA_FLASH


_REPORTED: set[str] = set()  # why the memory-efficient kernel ran, each reason logged once


def flash_blocker(query, attention_mask) -> str | None:
    """Why SDPA's FlashAttention kernel cannot take this call (None: it can): it takes no explicit
    mask, computes in fp16/bf16 only, and needs an Ampere or newer GPU."""
    import torch

    if attention_mask is not None:
        return "an explicit attention mask (padding)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(query.dtype).removeprefix('torch.')} inputs"
    if query.device.type == "cuda" and torch.cuda.get_device_capability(query.device) < (8, 0):
        major, minor = torch.cuda.get_device_capability(query.device)
        return f"compute capability {major}.{minor} (flash needs 8.0+)"
    return None


def _sdpa_flash_attention(module, query, key, value, attention_mask, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    why = flash_blocker(query, attention_mask)
    if why is not None and why not in _REPORTED:
        _REPORTED.add(why)
        log.info(
            "attention=flash: SDPA runs its memory-efficient kernel, not FlashAttention, for %s",
            why,
        )

    # Priority order: flash wherever it can run (no explicit mask, fp16/bf16), else mem-efficient.
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends, set_priority=True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
