"""Several LoRA adapters in one decode step, each row its own (batched LoRA, as vLLM's punica
kernels and S-LoRA do): each LoRA layer's adapters stacked once — ``a [adapters + 1, r_max, in]``,
``b [adapters + 1, r_max, out]`` (B transposed) with PEFT's scaling folded into ``b``, index 0 the
base model (zeros), lower ranks padded with zeros — and each row's delta a pair of matmuls over
the A and B its index picks (``LayerStack``).

PEFT's own per-row routing (``adapter_names``) registers hooks at every forward and splits the
batch by name on the host, which a compiled step cannot hold: with it a server that loads any
adapter decoded eagerly. Here a row's adapter is an index in a tensor at a fixed address
(``Rows.lora``), so the compiled step (a CUDA graph on a GPU) is the same whatever mix of adapters
its rows hold. The stacked layers are modules of the engine's own copy of the model
(decode_model.py), installed once in place of PEFT's layers there: PEFT's layers in the user's
model are never switched, hooked or written. Prompts, and a run whose rows PEFT must route, keep
PEFT's routing on the user's model.

What it does not handle — a LoRA variant (DoRA, aLoRA), a target that is not a linear layer, a
LoRA bias, merged weights, PEFT's ``modules_to_save`` or trainable tokens, a non-LoRA adapter —
leaves the model to PEFT's routing (``refusal`` says why)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LayerStack:
    """One LoRA layer's adapters stacked, and each row's delta on the layer's output:
    ``x [rows, q, in]`` -> ``(x @ a[k].T) @ b[k]`` for a row of adapter ``k``.

    Two ways to the same sum, chosen by shape (fixed in a compiled step): with no more adapters
    than rows, every adapter's A and B once as two matmuls, each row's ``x @ A.T`` masked to its
    own adapter's ranks — each weight read once, as a decode step (bound by memory) wants; with
    more, each row's own A and B gathered (vLLM's BGMV), which reads a row's adapter per row."""

    a: torch.Tensor  # [adapters + 1, r_max, in]
    b: torch.Tensor  # [adapters + 1, r_max, out], scaling folded in: B transposed, so that the
    # adapters' B are one [adapters * r_max, out] matrix for the first way
    index: torch.Tensor  # [max rows] long: each row's adapter (Rows.lora)
    slots: torch.Tensor  # [adapters]: 1..adapters

    def __call__(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        rows, width = x.shape[0], x.shape[-1]
        adapters, rank = self.slots.shape[0], self.a.shape[1]
        at = self.index[:rows]
        x = x.reshape(rows, -1, width).to(self.a.dtype)  # PEFT's cast to the adapter's dtype
        if adapters <= rows:
            h = x @ self.a[1:].reshape(-1, width).T  # [rows, q, adapters * r_max]
            own = (at[:, None] == self.slots).to(h.dtype)  # [rows, adapters]; none: the base
            h = (h.unflatten(-1, (adapters, rank)) * own[:, None, :, None]).flatten(-2)
            delta = h @ self.b[1:].reshape(adapters * rank, -1)
        else:
            delta = torch.bmm(torch.bmm(x, self.a[at].transpose(1, 2)), self.b[at])
        return output + delta.reshape(output.shape).to(output.dtype)


class StackedLinear(torch.nn.Module):
    """A LoRA layer of the engine's copy: the base layer (the user's weight) and the rows'
    deltas from the stacks, as PEFT's layer with its adapters off plus ``LayerStack``'s sum."""

    def __init__(self, base_layer: torch.nn.Module, stack: LayerStack):
        super().__init__()
        self.base_layer, self.stack = base_layer, stack

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.stack(x, self.base_layer(x, *args, **kwargs))


def refusal(model) -> Optional[str]:
    """Why batched LoRA cannot stand in for PEFT's routing of ``model`` (None: it can)."""
    from peft.tuners.lora import Linear, LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    other = [n for n, c in model.peft_config.items() if getattr(c, "peft_type", None) != "LORA"]
    if other:
        return f"adapters other than LoRA ({', '.join(other)})"
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            return f"{name}: modules_to_save or trainable tokens"
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            return f"{name}: {type(module).__name__}"
        if not isinstance(module, LoraLayer):
            continue
        if type(module) is not Linear:  # embeddings, convolutions, quantised layers
            return f"{name}: a {type(module).__name__} target (only linear layers)"
        if module.lora_variant:
            return f"{name}: a LoRA variant ({', '.join(module.lora_variant)}, e.g. DoRA)"
        if module.merged:
            return f"{name}: an adapter merged into the weights"
        for adapter in module.lora_A:
            a, b = module.lora_A[adapter], module.lora_B[adapter]
            if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear:
                return f"{name}: adapter {adapter}'s A/B are not linear layers"
            if a.bias is not None or b.bias is not None:
                return f"{name}: adapter {adapter} has a LoRA bias"
    return None


class BatchedLora:
    """The stacks of a PeftModel's LoRA layers, installed in the engine's copy of its base model
    (``own``); ``index`` holds each decode row's adapter (0 the base model, ``k`` the k-th of
    ``names``)."""

    def __init__(self, model, index: torch.Tensor):
        self.model, self.index = model, index
        self.names: Optional[tuple[str, ...]] = None  # the adapters the stacks hold
        self.layers: list[tuple[torch.nn.Module, LayerStack]] = []  # the user's layers
        self.installed: set[str] = set()  # the names of the copy's stacked layers
        self.stacked: list[str] = []  # the names of the user's layers the stacks hold
        self.refused: Optional[str] = refusal(model)

    @classmethod
    def of(cls, model, index: torch.Tensor) -> Optional[BatchedLora]:
        """For a PeftModel whose adapters batched LoRA can stand in for; None else."""
        if not getattr(model, "peft_config", None):
            return None
        lora = cls(model, index)
        if lora.refused is not None:
            log.info("batched LoRA off, PEFT routes adapters by row: %s", lora.refused)
            return None
        return lora

    def install(self, own: torch.nn.Module) -> None:
        """Each LoRA layer of ``own`` (the engine's copy of the base model, its names the user's
        base model's) becomes a ``StackedLinear`` over the copy's base layer: once."""
        from onegpu.infer.decode_model import replace_module

        self._build(tuple(self.model.peft_config))
        self.installed = set()
        base = self.model.get_base_model()
        stacks = {id(module): stack for module, stack in self.layers}
        for name, module in base.named_modules():
            if id(module) in stacks:
                layer = own.get_submodule(name)
                replace_module(own, name, StackedLinear(layer.base_layer, stacks[id(module)]))
                self.installed.add(name)

    def route(self, names: Optional[list[str]]) -> Optional[list[int]]:
        """Row ``i``'s index for adapter ``names[i]`` (or BASE; None: the model's one active
        adapter for every row), which the engine's rows write into the ``index`` the stacks read;
        None where the stacks cannot stand for them — PEFT's
        layers are off (inside ``model.disable_adapter()``) or merged, several adapters are
        active at once: PEFT routes them, on the user's model. Adapters loaded since on layers
        the copy does not stack: ``stale``."""
        current = tuple(self.model.peft_config)
        if current != self.names:  # adapters were loaded (or deleted) since the stacks were built
            self._build(current)
        if self.refused is not None:
            return None
        if any(m.disable_adapters or m.merged for m, _ in self.layers):
            return None
        if names is None:
            active = self.model.active_adapters
            if len(active) != 1:
                return None
            names = [active[0]] * self.index.shape[0]
        at = {name: k + 1 for k, name in enumerate(self.names)}
        return [at.get(n, 0) for n in names]

    def stale(self) -> bool:
        """Adapters were loaded since on layers the engine's copy does not stack (its caller
        makes the copy again and ``install``s the stacks in it)."""
        if tuple(self.model.peft_config) != self.names:
            self._build(tuple(self.model.peft_config))
        return self.refused is None and not set(self.stacked) <= self.installed

    def reload(self) -> None:
        """The adapters' weights changed (a training step): copy them into the stacks again (in
        place: a compiled step holds the stacks)."""
        if self.refused is None and self.names is not None:
            self._fill()

    def _build(self, names: tuple[str, ...]) -> None:
        """The stacks of ``names``, in place where the copy's layers hold them already (their
        tensors change size only when the adapters do: a compiled step then recompiles)."""
        self.refused = refusal(self.model)
        if self.refused is not None:
            log.info("batched LoRA off, PEFT routes adapters by row: %s", self.refused)
            return
        from peft.tuners.lora import LoraLayer

        old = {id(m): stack for m, stack in self.layers}
        self.names, self.layers, self.stacked = names, [], []
        base = self.model.get_base_model()
        for name, module in base.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            held = [n for n in names if n in module.lora_A]
            if not held:
                continue
            rank = max(module.lora_A[n].out_features for n in held)
            like = module.lora_A[held[0]].weight  # the adapters' dtype and device
            kw = {"dtype": like.dtype, "device": like.device}
            a = torch.zeros(len(names) + 1, rank, module.in_features, **kw)
            b = torch.zeros(len(names) + 1, rank, module.out_features, **kw)
            slots = torch.arange(1, len(names) + 1, device=like.device)
            if self.index.device.type == "cuda":  # a CUDA graph reads them where they lie
                for t in (a, b, slots):
                    torch._dynamo.mark_static_address(t)
            stack = old.get(id(module))
            if stack is None:
                stack = LayerStack(a, b, self.index, slots)
            else:  # the copy's layer holds this stack: new tensors, the same object
                stack.a, stack.b, stack.slots = a, b, slots
            self.layers.append((module, stack))
            self.stacked.append(name)
        kept = {id(stack) for _, stack in self.layers}
        for stack in old.values():  # a layer that holds no adapter now adds nothing
            if id(stack) not in kept:
                stack.a.zero_()
                stack.b.zero_()
        self._fill()

    def _fill(self) -> None:
        with torch.no_grad():
            for module, stack in self.layers:
                stack.a.zero_()
                stack.b.zero_()
                for k, name in enumerate(self.names, start=1):
                    if name not in module.lora_A:  # this adapter leaves the layer alone
                        continue
                    a, b = module.lora_A[name].weight, module.lora_B[name].weight
                    stack.a[k, : a.shape[0]] = a
                    stack.b[k, : b.shape[1]] = b.T * module.scaling[name]
