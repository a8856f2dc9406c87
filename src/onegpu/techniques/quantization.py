"""Quantized weights: bitsandbytes int8 (LLM.int8) and 4-bit (nf4/fp4) configs for loading."""

from __future__ import annotations

from onegpu.errors import UnavailableError


def bnb_config(kind: str, compute_dtype=None, double_quant: bool = True, int8_threshold: float = 6.0):
    """A transformers BitsAndBytesConfig for kind in {"int8", "nf4", "fp4"}.

    int8 is LLM.int8(): outlier features above ``int8_threshold`` stay in 16-bit, the rest int8.
    4-bit stores weights in nf4 (normal-float, best for normally distributed weights) or fp4, with
    optional double quantization of the scales; matmuls run in ``compute_dtype``.
    """
    import torch

    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UnavailableError("bitsandbytes is not installed.", hint="pip install 'onegpu[bnb]'") from None
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=int8_threshold)
    if kind in ("nf4", "fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                  bnb_4bit_use_double_quant=double_quant,
                                  bnb_4bit_compute_dtype=compute_dtype or torch.float32)
    raise UnavailableError(f"unknown bitsandbytes quantization '{kind}'.", hint="use int8, nf4 or fp4")
