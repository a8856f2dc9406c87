"""What trains in a vision-language model (techniques.vision): the language model always; the
projector (the layers that map the tower's features into the LM's embedding space) with
``projector`` or ``all``; the vision tower with ``all``. Frozen by default, as LLaVA's and TRL's
recipes fine-tune: the tower was pretrained on far more images than a fine-tune brings.

Full fine-tuning: the frozen parts get requires_grad False (no gradients, no optimizer state).
LoRA: adapters go on the language model's linear layers (PEFT's all-linear would put them on the
tower too), and on the tower's with ``all``; the projector trains whole (PEFT's modules_to_save,
so the adapter folder holds it).
"""

from __future__ import annotations

import logging

from onegpu import vlm
from onegpu.config import TechniquesConfig

log = logging.getLogger(__name__)


def is_vision_model(model) -> bool:
    return vlm.is_vision_config(getattr(model, "config", None))


def apply_vision(model, tcfg: TechniquesConfig):
    """Freeze the tower / projector as techniques.vision says (full fine-tuning; under LoRA the
    adapters' own freezing applies, see ``lora_targets``)."""
    if not is_vision_model(model) or tcfg.lora.enabled:
        return model
    tower, projector = vlm.vision_modules(model)
    frozen = {"frozen": tower + projector, "projector": tower, "all": []}[tcfg.vision]
    trains = {"frozen": [], "projector": projector, "all": tower + projector}[tcfg.vision]
    modules = dict(model.named_modules())
    for name in frozen:
        modules[name].requires_grad_(False)
    for name in trains:  # the projector may sit inside the tower (Qwen2-VL's visual.merger)
        modules[name].requires_grad_(True)
    total = sum(p.numel() for p in model.parameters())
    still = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "techniques.vision=%s: %d of %d parameters train (vision tower %s, projector %s)",
        tcfg.vision,
        still,
        total,
        "trains" if tcfg.vision == "all" else "frozen",
        "frozen" if tcfg.vision == "frozen" else "trains",
    )
    return model


def lora_targets(model, targets, mode: str):
    """(PEFT target_modules, modules_to_save) for a vision-language model: ``targets`` (the resolved
    techniques.lora.targets: "all-linear" or short names) kept to the language model's linear
    layers, and to the tower's too with mode ``all``; the projector as a module to save whole with
    ``projector`` / ``all``. A text model: (targets, None) unchanged."""
    if not is_vision_model(model):
        return targets, None
    import torch

    tower, projector = vlm.vision_modules(model)
    head = model.get_output_embeddings()
    heads = {n for n, m in model.named_modules() if m is head}

    def inside(name: str, roots: list[str]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    names = []
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linears:
        if name in heads or inside(name, projector):
            continue
        if inside(name, tower) and mode != "all":
            continue
        if targets != "all-linear" and name.rsplit(".", 1)[-1] not in targets:
            continue
        names.append(name)
    save = projector if mode in ("projector", "all") else None
    return names, save


def no_gradient_to_pixels(model) -> None:
    """Undo, for a vision-language model's tower, what transformers' checkpointing switch does to
    every input embedding it finds (``enable_input_require_grads``: their outputs require grad, so
    a frozen token embedding under LoRA still passes gradients on). On the vision tower's patch
    embedding that makes the whole tower, frozen or not, keep its layers' inputs for backward and
    run a backward down to the pixels, whose gradient nothing reads. The hook stays on the
    language model's token embedding only; a tower that trains still gets its weights' gradients
    (the checkpointing is non-reentrant, which needs no input that requires grad)."""
    if not is_vision_model(model):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    decoder = base.get_decoder()
    base.disable_input_require_grads()
    decoder.disable_input_require_grads()  # once: it may have been set on the decoder before
    decoder.enable_input_require_grads()
