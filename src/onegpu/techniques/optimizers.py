"""Optimizer choice: torch AdamW (foreach / fused), Adafactor, 8-bit and 4-bit Adam, SGD.

Weight decay never touches biases or norm weights. Optional backends (bitsandbytes, torchao) are
imported only when asked for, and a missing one raises an UnavailableError with the install line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from onegpu.config import TechniquesConfig, TrainingConfig
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)  # beta2 0.95 rather than 0.999: steadier for LM pre-training and fine-tuning


def param_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters split by whether decay applies.

    Every bias and norm weight (RMSNorm/LayerNorm scale, DoRA magnitude) is 1-D, and every matrix
    (linear, embedding) is >= 2-D, so the rank is a reliable, architecture-free rule: decaying a
    norm scale towards zero would fight the normalisation it exists to learn.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Under ZeRO-3 a parameter is an empty local shard; ds_shape is its real shape.
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def build_optimizer(model, tcfg: TechniquesConfig, train: TrainingConfig) -> torch.optim.Optimizer:
    from onegpu.hyper import bare

    train = bare(
        train
    )  # a run's section is settled already; a bare one (planner, tests) takes the scratch values
    groups = param_groups(model, train.weight_decay)
    if not groups:
        raise ConfigError(
            "the model has no trainable parameters, so there is nothing to optimize.",
            hint="check techniques.lora.targets, or turn techniques.lora.quantize_base off",
        )
    name = tcfg.optimizer
    if name not in BUILDERS:
        raise ConfigError(
            f"techniques.optimizer: unknown optimizer '{name}'.",
            hint=f"choose one of: {', '.join(BUILDERS)}",
        )
    # Training builds the optimizer before Accelerate moves the model to its device, and that device
    # is the CUDA GPU whenever one is available (hardware.detect): the parameters alone would say
    # CPU.
    on_cuda = torch.cuda.is_available() or any(p.is_cuda for g in groups for p in g["params"])
    if tcfg.optimizer_in_backward:
        from onegpu.techniques.optimizer_in_backward import OptimizerInBackward

        opt = OptimizerInBackward(groups, lambda one: BUILDERS[name](one, train.lr, on_cuda))
        log.info("optimizer: %s, stepped inside backward per parameter (%r)", name, opt)
        return opt
    opt = BUILDERS[name](groups, train.lr, on_cuda)
    log.info("optimizer: %s (%s.%s)", name, type(opt).__module__, type(opt).__name__)
    return opt


# ------------------------------------------------------------------------------------ torch
def _adamw(groups, lr, on_cuda):
    """Fastest torch implementation here: the fused kernel (one pass over all parameters; on CUDA
    and, since torch 2.4, on CPU too, where it measured ~4x faster than foreach), else foreach."""
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True)
    except RuntimeError:  # a device or dtype without the fused kernel
        return _adamw_foreach(groups, lr, on_cuda)


def _adamw_foreach(groups, lr, on_cuda):
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, foreach=True)


def _adamw_fused(groups, lr, on_cuda):
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True)
    except RuntimeError as exc:  # old torch or an unsupported device/dtype
        raise UnavailableError(
            f"techniques.optimizer=adamw-fused is not supported here: {exc}",
            hint="use techniques.optimizer=adamw-foreach, or upgrade torch",
        ) from None


def _adafactor(groups, lr, on_cuda):
    """Factored second moment: a row and a column vector per matrix instead of a full matrix,
    and no first moment, so state is ~O(rows + cols) rather than 2x the parameters."""
    if not hasattr(torch.optim, "Adafactor"):
        raise UnavailableError(
            "techniques.optimizer=adafactor needs torch.optim.Adafactor (torch >= 2.5).",
            hint="pip install -U torch",
        )
    # Single-tensor: the foreach form (a card's default) builds every matrix's full-size variance
    # estimate at once, a whole model of temporaries in the step of the optimizer chosen for its
    # small memory; one tensor at a time holds one.
    return torch.optim.Adafactor(groups, lr=lr, foreach=False)


def _sgd(groups, lr, on_cuda):
    """SGD with momentum, fused where torch has the kernel (CUDA, and CPU since torch 2.4): one
    pass in place. foreach, a card's default otherwise, builds a decayed copy of every gradient
    of a weight-decayed group at once (a whole model's worth of temporaries at the step)."""
    try:
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, fused=True)
    except RuntimeError:  # a device or dtype without the fused kernel
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=True)


# ------------------------------------------------------------------------------ bitsandbytes
def _bnb():
    from onegpu.techniques.quantization import import_bitsandbytes

    return import_bitsandbytes(
        "techniques.optimizer=adamw-8bit / paged-adamw-8bit", "or choose techniques.optimizer=adamw"
    )


def _adamw_8bit(groups, lr, on_cuda):
    """Block-wise quantized Adam state (uint8 + one fp32 scale per 256 values): 2 bytes per
    parameter instead of 8. Tensors under 4096 values keep 32-bit state (not worth quantizing)."""
    return _bnb().optim.AdamW8bit(groups, lr=lr, betas=BETAS)


def _paged_adamw_8bit(groups, lr, on_cuda):
    """As adamw-8bit, with state in CUDA unified memory that pages to the host under pressure
    instead of failing with OOM on a memory spike."""
    if not on_cuda:
        log.info(
            "paged-adamw-8bit: paging needs CUDA unified memory; on this device it runs as "
            "adamw-8bit"
        )
    return _bnb().optim.PagedAdamW8bit(groups, lr=lr, betas=BETAS)


# ---------------------------------------------------------------------------------- torchao
def _torchao_optim():
    try:
        import torchao.optim as ao_optim
    except ImportError:
        raise UnavailableError(
            "torchao low-bit optimizers need torchao, which is not installed.",
            hint="pip install 'onegpu[torchao]', or choose techniques.optimizer=adamw-8bit",
        ) from None
    return ao_optim


def _adamw_8bit_ao(groups, lr, on_cuda):
    """torchao's 8-bit AdamW: state is a quantized tensor subclass, step compiled by
    torch.compile."""
    return _torchao_optim().AdamW8bit(groups, lr=lr, betas=BETAS)


def _adamw_4bit_ao(groups, lr, on_cuda):
    """torchao's 4-bit AdamW: half the state of the 8-bit one (1 byte per parameter for both
    moments)."""
    return _torchao_optim().AdamW4bit(groups, lr=lr, betas=BETAS)


BUILDERS: dict[str, Callable] = {
    "adamw": _adamw,
    "adamw-foreach": _adamw_foreach,
    "adamw-fused": _adamw_fused,
    "adafactor": _adafactor,
    "adamw-8bit": _adamw_8bit,
    "paged-adamw-8bit": _paged_adamw_8bit,
    "adamw-8bit-ao": _adamw_8bit_ao,
    "adamw-4bit-ao": _adamw_4bit_ao,
    "sgd": _sgd,
}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer state, counting the packed storage of quantized tensor subclasses
    (torchao keeps codes + scales inside a wrapper whose nominal dtype is fp32)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _tensor_bytes(value)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    flatten = getattr(t, "__tensor_flatten__", None)
    if (
        flatten is not None
        and type(t) is not torch.Tensor
        and not isinstance(t, torch.nn.Parameter)
    ):
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
