"""Inference: ``load`` a causal LM (loading.py), the decode engine (engine.py, not imported
here: it imports torch) and ``generate`` from prompts on it (generation.py)."""

from onegpu.infer.generation import Completion, SamplingConfig, generate, generate_chats
from onegpu.infer.hf_generate import generation_kwargs
from onegpu.infer.loading import InferConfig, Loaded, load, parse_max_memory, resolve_model
from onegpu.infer.requests import Result, SamplingParams, Update

__all__ = [
    "Completion",
    "Result",
    "SamplingParams",
    "Update",
    "InferConfig",
    "Loaded",
    "SamplingConfig",
    "generate",
    "generate_chats",
    "generation_kwargs",
    "load",
    "parse_max_memory",
    "resolve_model",
]
