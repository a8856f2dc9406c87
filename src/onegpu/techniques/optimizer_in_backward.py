"""Optimizer step in backward: each parameter is updated by its own optimizer the moment its
gradient is complete (a post-accumulate-grad hook), and the gradient is freed at once, so the full
set of gradients never exists: gradient memory falls from one copy of the trainable weights to
about one tensor. torchtune's ``optimizer_in_bwd`` and the "fused backward + optimizer" recipes
for 8B full fine-tuning on 24 GB cards use the same idea.

What it rules out, each refused by ``config.validate`` with the reason:
- gradient accumulation (a micro-batch's gradient would be applied before the next one adds to it);
- clipping by the global norm (the norm is only known once every gradient exists);
- fp16 loss scaling (the scaler would have to unscale and check all gradients first);
- several processes (DDP/FSDP reduce gradients after the hook would already have used them);
- DeepSpeed offload (it runs its own optimizer).
A non-finite loss is caught before backward instead of after it (see training/step.py); an
out-of-memory error inside backward cannot be retried exactly (part of the weights has moved), so
the OOM retry is off with this switch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

log = logging.getLogger(__name__)


class OptimizerInBackward(torch.optim.Optimizer):
    """One inner optimizer per trainable parameter, stepped from that parameter's gradient hook.

    To the loop, the LR scheduler and checkpoints it is an ordinary optimizer: ``param_groups`` are
    the inner optimizers' own group dicts (so a scheduler's lr reaches them), ``state`` maps each
    parameter to its inner state, ``step``/``zero_grad`` have nothing left to do, and
    ``state_dict``/``load_state_dict`` round-trip every inner optimizer.
    """

    steps_in_backward = True

    def __init__(self, groups: list[dict], build: Callable[[list[dict]], torch.optim.Optimizer]):
        # No super().__init__: the parameters belong to the inner optimizers, not to this facade.
        self.inner: list[torch.optim.Optimizer] = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            self.inner += [build([{"params": [p], **options}]) for p in group["params"]]
        self.defaults = dict(self.inner[0].defaults) if self.inner else {}
        for opt in self.inner:  # for the parameters' lifetime: the optimizer is built once per run
            for p in opt.param_groups[0]["params"]:
                p.register_post_accumulate_grad_hook(self._hook(opt))
        self._link()

    @staticmethod
    def _hook(opt: torch.optim.Optimizer):
        def step_now(param: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)  # the gradient is gone before the next one is computed

        return step_now

    def _link(self) -> None:
        self.param_groups = [g for opt in self.inner for g in opt.param_groups]
        self.state = _States(self.inner)

    def step(self, closure=None):  # every update already happened during backward
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.inner:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer_in_backward": [opt.state_dict() for opt in self.inner]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizer_in_backward")
        if saved is None or len(saved) != len(self.inner):
            raise ValueError(
                "the saved optimizer state was not written with techniques.optimizer_in_backward "
                "over the same parameters"
            )
        for opt, sd in zip(self.inner, saved, strict=True):
            opt.load_state_dict(sd)
        self._link()  # load_state_dict gives each inner optimizer new group and state objects

    def __repr__(self) -> str:
        kind = type(self.inner[0]).__name__ if self.inner else "none"
        return f"OptimizerInBackward({len(self.inner)} x {kind})"


class _States(Mapping):
    """parameter -> its inner optimizer's state: a read-only view over the inner optimizers."""

    def __init__(self, inner: list[torch.optim.Optimizer]):
        self._inner = inner

    def _merged(self) -> dict:
        return {p: s for opt in self._inner for p, s in opt.state.items()}

    def __getitem__(self, param):
        for opt in self._inner:  # one parameter per inner optimizer: no need to merge them all
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __iter__(self):
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())


def steps_in_backward(optimizer) -> bool:
    """Whether ``optimizer`` (possibly wrapped by Accelerate) updates the weights during
    backward."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return bool(getattr(inner, "steps_in_backward", False))
