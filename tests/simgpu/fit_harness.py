"""The training loop (``onegpu.train``) on a simulated card: what a whole run needs beyond a step.

Inside ``on_the_card()`` a run goes through its real assembly, loop, evaluation and metrics; the
card's "cuda" tensors are fake (cards.fake_cuda). What this adds to cards.py's substitutions, and
why (nothing in src/ is patched):
- parameters moved by Accelerate's device placement keep their identity:
  ``torch.__future__.set_swap_module_params_on_conversion(True)`` makes ``module.to("cuda")`` swap
  each parameter's contents in place (``torch.utils.swap_tensors``). A real ``.to()`` assigns
  ``param.data``, which a fake tensor cannot take from a real one; without the swap the model would
  get new Parameter objects and the optimizer built before the placement would hold the old host
  ones;
- page-locked batches: the DataLoader pins each batch (``pin_memory=True`` on a GPU); pinning needs
  the CUDA host allocator, which is not there, so ``Tensor.pin_memory`` answers the batch as it is
  (a real card returns a page-locked copy of the same values);
- the final model's write (transformers' ``PreTrainedModel.save_pretrained``): fake weights hold
  no values (nor storage addresses, which transformers reads to find tied weights), so it is given
  a state dict of host zeros of each weight's shape and dtype; the file has the model's names,
  shapes and dtypes, not trained weights. A LoRA run's adapter (PEFT's ``save_pretrained``, whose
  ``safe_save_file`` is given the same host zeros) likewise. Checkpoints are not written at all
  (``training.save_every: 0``);
- tensors made from Python numbers on the card (``Tensor.new_tensor``, DPO's pair count): torch's
  constructor allocates on the device itself, below the fake mode, so the tensor is made on the
  host and moved, as cards.py does for batches (the same values on a real card);
- the fake mode's memory of tensors: swap_tensors refuses a tensor something holds a weak
  reference to, and the converter's describer holds one to every real tensor it converts (the
  parameters being placed), so it holds them strongly in the block. Both memos (this one and
  cards.fake_cuda's) are emptied when the block ends, so the run's card memory is given back with
  its objects;
- values read by the loop (the logged loss, the validation loss) are cards.fake_value's
  ``value``; the NaN guard's bool read answers whether it is finite.
"""

from __future__ import annotations

import contextlib

import cards


@contextlib.contextmanager
def on_the_card(value: float):
    """Run what the block runs on the simulated card, the substitutions above in force; a fake
    scalar reads ``value``."""
    import peft.peft_model
    import torch
    from transformers import PreTrainedModel

    write, adapter_write = PreTrainedModel.save_pretrained, peft.peft_model.safe_save_file
    pin = torch.Tensor.pin_memory
    made = torch.Tensor.new_tensor
    swap = torch.__future__.get_swap_module_params_on_conversion()

    def zeros_save(model, directory, *args, state_dict=None, **kwargs):
        state_dict = state_dict if state_dict is not None else model.state_dict()
        return write(model, directory, *args, state_dict=_zeros(state_dict), **kwargs)

    def adapter_zeros_save(tensors, filename, metadata=None):
        return adapter_write(_zeros(tensors), filename, metadata=metadata)

    def unpinned(t, device=None):
        return t

    def new_tensor(t, data, dtype=None, device=None, requires_grad=False, **kw):
        target = torch.device(device) if device is not None else t.device
        if target.type != "cuda":
            return made(t, data, dtype=dtype, device=device, requires_grad=requires_grad, **kw)
        host = made(t.new_empty(0, device="cpu"), data, dtype=dtype or t.dtype)
        return host.to(target).requires_grad_(requires_grad)

    PreTrainedModel.save_pretrained = zeros_save
    peft.peft_model.safe_save_file = adapter_zeros_save
    torch.Tensor.pin_memory = unpinned
    torch.Tensor.new_tensor = new_tensor
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with cards.fake_cuda() as mode, cards.fake_value(value):
            # strong, so the parameters being placed can be swapped (see the docstring)
            converter = mode.fake_tensor_converter.meta_converter
            converter.describer.lookup_tensor = {}
            try:
                yield mode
            finally:
                # Both strong memos hold the run's card tensors (its parameters among them): drop
                # them, so the card's memory is given back when the run's objects are.
                converter.describer.lookup_tensor.clear()
                converter.tensor_memo.clear()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        torch.Tensor.pin_memory = pin
        torch.Tensor.new_tensor = made
        PreTrainedModel.save_pretrained = write
        peft.peft_model.safe_save_file = adapter_write


def _zeros(tensors: dict) -> dict:
    """Host zeros of the shapes and dtypes of ``tensors`` (fake ones hold no values to write)."""
    import torch

    return {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in tensors.items()}
