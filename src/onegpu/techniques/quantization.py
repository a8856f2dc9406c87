"""Quantized weights: bitsandbytes int8 (LLM.int8) and 4-bit (nf4/fp4) configs for loading."""

from __future__ import annotations

from onegpu.errors import UnavailableError


def import_bitsandbytes(needed_for: str, instead: str):
    """bitsandbytes, or one UnavailableError that tells a missing package from one that is installed
    but fails to import (a CUDA library, triton or torch version it needs): only the package itself
    missing is "not installed"; otherwise the real first line of the failure is shown."""
    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - a broken install raises ImportError, OSError, RuntimeError...
        if isinstance(exc, ModuleNotFoundError) and exc.name == "bitsandbytes":
            raise UnavailableError(
                f"bitsandbytes (for {needed_for}) is not installed.",
                hint=f"pip install 'onegpu[bnb]', {instead}",
            ) from None
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise UnavailableError(
            f"bitsandbytes (for {needed_for}) is installed but fails to import: {detail}",
            hint=f"repair it (pip install --force-reinstall bitsandbytes, built for this torch "
            f"and CUDA; onegpu doctor shows both), {instead}",
        ) from None
    return bitsandbytes


def bnb_config(
    kind: str,
    compute_dtype=None,
    double_quant: bool = True,
    int8_threshold: float = 6.0,
    setting: str | None = None,
    instead: str | None = None,
):
    """A transformers BitsAndBytesConfig for kind in {"int8", "nf4", "fp4"}.

    int8 is LLM.int8(): outlier features above ``int8_threshold`` stay in 16-bit, the rest int8.
    4-bit stores weights in nf4 (normal-float, best for normally distributed weights) or fp4, with
    optional double quantization of the scales; matmuls run in ``compute_dtype``.

    Where bitsandbytes cannot run, the error names the caller's own setting (``setting``) and the
    way round it (``instead``): a fix from another command's flags would be refused there. The
    defaults are the loading flags of `onegpu generate` / `serve`; training passes its own.
    """
    import torch

    import_bitsandbytes(
        setting or f"--quantization {kind}",
        instead
        or "or load without it: --quantization none, or ao-int8 (torchao's int8 weights, no "
        "bitsandbytes)",
    )
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=int8_threshold)
    if kind in ("nf4", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=kind,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype or torch.float32,
        )
    raise UnavailableError(
        f"unknown bitsandbytes quantization '{kind}'.", hint="use int8, nf4 or fp4"
    )


# torchao methods, applied with quantize_ after the model is loaded and placed on its device.
TORCHAO_KINDS = ("ao-int8", "ao-int8-dynamic", "ao-int4")
BNB_KINDS = ("int8", "nf4", "fp4")


def torchao_config(kind: str, device_type: str, dtype=None):
    """The torchao config object (torchao>=0.10 config API) for ``kind``.

    ao-int8: int8 per-channel weights, activations stay in floating point (weight-only; cuts memory
    traffic, the decode bottleneck). ao-int8-dynamic: int8 weights and per-token int8 activations
    quantized on the fly (int8 matmuls; helps compute-bound prefill). ao-int4: grouped int4 weights
    for the tinygemm CUDA kernel, which has no CPU implementation and needs bf16 activations.
    """
    ao = _import_torchao()
    if kind == "ao-int8":
        return ao.Int8WeightOnlyConfig()
    if kind == "ao-int8-dynamic":
        return ao.Int8DynamicActivationInt8WeightConfig()
    if kind == "ao-int4":
        import torch

        if device_type != "cuda":
            raise UnavailableError(
                f"torchao int4 weight-only quantization has no kernel for device '{device_type}'.",
                hint="use --quantization ao-int8 or nf4 on CPU, or run on a CUDA GPU",
            )
        if dtype is not None and dtype != torch.bfloat16:
            raise UnavailableError(
                f"torchao int4 (tinygemm) needs bf16 activations, got {dtype}.",
                hint="add --dtype bf16",
            )
        return ao.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    raise UnavailableError(
        f"unknown torchao quantization '{kind}'.", hint=f"use one of: {', '.join(TORCHAO_KINDS)}"
    )


def apply_torchao(model, kind: str, device_type: str, dtype=None):
    """Quantize every nn.Linear except the output head in place: its weight becomes a torchao tensor
    subclass. The head is kept in full precision because logits are where int8 error shows most;
    unmerged LoRA matrices are kept too (they are tiny, and rank-r matmuls gain nothing)."""
    import torch

    ao = _import_torchao()
    config = torchao_config(kind, device_type, dtype)
    head = model.get_output_embeddings()

    def keep(module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module is not head and "lora_" not in fqn

    ao.quantize_(model, config, filter_fn=keep)
    return model


def _import_torchao():
    try:
        import torchao.quantization as ao
    except ImportError:
        raise UnavailableError(
            "torchao is not installed.", hint="pip install 'onegpu[torchao]'"
        ) from None
    return ao


def _is_torchao(t) -> bool:
    return type(t).__module__.startswith("torchao")


def weight_bytes(model) -> int:
    """Bytes held by the model's parameters and buffers, counting what quantized tensors really
    store: the inner tensors of torchao subclasses, and the scales bitsandbytes keeps beside its
    packed int8/uint8 data (``SCB``, ``quant_state``)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += _tensor_bytes(t)
    return total


def _tensor_bytes(t) -> int:
    import torch

    if _is_torchao(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    total = t.numel() * t.element_size()
    scb = getattr(t, "SCB", None)
    if isinstance(scb, torch.Tensor):
        total += scb.numel() * scb.element_size()
    state = getattr(t, "quant_state", None)
    if state is not None:
        total += _quant_state_bytes(state)
    return total


def _quant_state_bytes(state) -> int:
    import torch

    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif type(value).__name__ == "QuantState":  # nested state of double quantization
            total += _quant_state_bytes(value)
    return total


class _Once:
    """A logging filter that lets each distinct message template through once."""

    def __init__(self):
        self.seen: set = set()

    def filter(self, record) -> bool:
        if record.msg in self.seen:
            return False
        self.seen.add(record.msg)
        return True


def quiet_int8_cast_warning() -> None:
    """bitsandbytes logs the int8 input cast on every matmul (hundreds per generated token); the
    first time says all there is to say."""
    import logging

    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Once) for f in logger.filters):
        logger.addFilter(_Once())
