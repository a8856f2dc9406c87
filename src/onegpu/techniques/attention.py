"""Attention kernel choice: eager, PyTorch SDPA, or FlashAttention.

"flash" means the flash_attn package (attn_implementation="flash_attention_2") when it is
installed, otherwise PyTorch SDPA restricted to its FlashAttention kernel, with the memory-efficient
kernel as the only fallback (for batches whose padding mask flash cannot take). The restriction is
an attention function registered with transformers' AttentionInterface, so it applies exactly
around each attention call, also under torch.compile and gradient checkpointing recomputes.
"""

from __future__ import annotations

import importlib.util
import logging

from onegpu.config import TechniquesConfig
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)

# No "flash" in the name on purpose: transformers treats any such name as a flash_attn package request.
SDPA_FLASH = "sdpa_fa_kernel"


def resolve_attention(tcfg: TechniquesConfig, device: DeviceInfo) -> str:
    """The attn_implementation to load a model for training with."""
    return attention_implementation(tcfg.attention, device.type, device.name)


def attention_implementation(want: str, device_type: str, device_name: str = "") -> str:
    """The attn_implementation for a choice (auto / eager / sdpa / flash) on a device: the one
    resolution, used by training and inference alike."""
    if want == "auto":
        return "sdpa"  # SDPA already dispatches to flash/mem-efficient kernels where they apply
    if want != "flash":
        return want
    if device_type != "cuda":
        log.warning("attention=flash needs a CUDA GPU; using sdpa on %s instead", device_name or device_type)
        return "sdpa"
    if flash_attn_installed():
        return "flash_attention_2"
    register_sdpa_flash()
    log.info("attention: SDPA with the FlashAttention kernel (flash_attn package not installed)")
    return SDPA_FLASH


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def register_sdpa_flash() -> str:
    """Register SDPA_FLASH with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_FLASH, _sdpa_flash_attention)
    AttentionMaskInterface.register(SDPA_FLASH, sdpa_mask)  # same masks as plain SDPA
    return SDPA_FLASH


def _sdpa_flash_attention(module, query, key, value, attention_mask, **kwargs):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # Priority order: flash wherever it can run (no explicit mask, fp16/bf16), else mem-efficient.
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends, set_priority=True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_of(model) -> str:
    """The attention implementation a loaded model really uses."""
    return model.config._attn_implementation
