"""The engine's own model for its decode steps: a copy of the user's module tree that shares every
parameter and buffer with it (no weight is copied), made once when the engine is built, with the
engine's choices set on it once — its decode attention (gqa_attention's or cpu_attention's, which
hand a prefill to transformers' SDPA), MoE experts as ``batched_mm`` in a compiled step, the
batched LoRA layers (batched_lora.py) in place of PEFT's. The user's model, its config and its
layers are never written: its prefill forwards, a caller's training step and its own ``generate``
see it as it was given, and the decode steps see the weights as they are now (shared tensors).

A model whose weights are placed by accelerate's hooks (a device map with offloading) keeps its
hooks' own copies of the weights, which a copy of the tree would duplicate: the engine decodes on
it as it is (``copyable``)."""

from __future__ import annotations

import copy
import itertools
from typing import Optional

import torch


def copyable(model: torch.nn.Module) -> bool:
    """No accelerate hook places the weights (each holds its own map of them)."""
    return not any(hasattr(m, "_hf_hook") for m in model.modules())


def decode_model(
    model: torch.nn.Module, attention: Optional[str], experts: bool
) -> torch.nn.Module:
    """A copy of ``model``'s module tree (a transformers model, not a PEFT wrapper) over the same
    tensors, in eval mode (the engine only infers), its attention set to ``attention`` (a name
    registered in transformers' AttentionInterface) and, with ``experts``, its MoE experts to
    ``batched_mm``; both through transformers' own setters, on the copy."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    own = copy.deepcopy(model, memo=shared)
    own.eval()
    if attention is not None:
        own.set_attn_implementation(attention)
    if experts:
        own.set_experts_implementation("batched_mm")
    return own


def replace_module(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Put ``new`` where ``root``'s submodule ``name`` is (a module of the engine's own copy)."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def moe(model) -> bool:
    """The model has experts that transformers dispatches by implementation."""
    if getattr(model.config, "_experts_implementation", None) is None:
        return False
    return any(getattr(m, "has_gate", None) is not None for m in model.modules())
