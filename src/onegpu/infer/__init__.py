"""Inference: ``load`` a causal LM (loading.py) and ``generate`` from prompts (generation.py)."""

from onegpu.infer.generation import Completion, SamplingConfig, generate, generation_kwargs
from onegpu.infer.loading import InferConfig, Loaded, load, parse_max_memory, resolve_model

__all__ = [
    "Completion",
    "InferConfig",
    "Loaded",
    "SamplingConfig",
    "generate",
    "generation_kwargs",
    "load",
    "parse_max_memory",
    "resolve_model",
]
