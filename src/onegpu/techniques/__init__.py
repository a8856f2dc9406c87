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
    from onegpu.techniques.checkpointing import apply_checkpointing
    from onegpu.techniques.compile import apply_compile
    from onegpu.techniques.lora import apply_lora
    from onegpu.techniques.loss import enable_router_aux_loss

    enable_router_aux_loss(model)  # MoE: train the router's load balancing too (a config switch)
    model = apply_lora(model, tcfg)  # first: it replaces the Linear layers the later steps see
    model = apply_checkpointing(model, tcfg, device.type)  # after LoRA, before compile: see above
    model = apply_compile(model, tcfg, device.type)
    return model
