"""What ``onegpu generate`` takes for sampling and gives back per prompt (no torch here: the CLI's
help is built from it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass
class SamplingConfig:
    """How prompts are fed to the model and completions sampled."""

    chat: Union[bool, Literal["auto"]] = "auto"
    """Prompts are user turns: each is put through the tokenizer's chat template, ending where the
    assistant's answer begins. auto: on for a model onegpu trained on chat (messages) data, off for
    anything else (a template alone decides nothing: base models ship one, and so does every
    tokenizer onegpu trains). true needs a tokenizer with a chat template."""
    max_new_tokens: int = 128
    """Tokens to generate per prompt at most."""
    greedy: bool = False
    """Always pick the most likely token (deterministic). Same as temperature 0."""
    temperature: float = 0.8
    """Sampling temperature (0 = greedy)."""
    top_p: float = 0.95
    """Nucleus sampling: sample from the smallest token set with this total probability (1 = off).
    """
    top_k: int = 50
    """Sample from the k most likely tokens only (0 = off)."""
    repetition_penalty: float = 1.0
    """Divide the scores of already generated tokens by this (1 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop a sequence when it produces any of these strings (cut from the output)."""
    batch_size: int = 8
    """Prompts generated together (left padded)."""
    seed: int = 1234
    """Seed for sampling; the same seed and prompts give the same output."""
    decoder: Literal["engine", "hf"] = "engine"
    """engine: onegpu's decode engine (a KV cache sized to the request, all prompts decoded
    together as slots free up, sampling on the device). hf: transformers' generate (left-padded
    batches; static_cache applies)."""
    compile: Literal["auto", "off", "default", "reduce-overhead", "max-autotune"] = "auto"
    """torch.compile the one-token decode step. auto: on a GPU (captured as a CUDA graph), not on
    a CPU (compiling takes about a minute there). The first call pays for compilation."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    static_cache: bool = False
    """decoder hf: preallocate transformers' KV cache to its final size (the engine always does,
    sized to the request)."""
    speculative: Optional[Literal["ngram"]] = None
    """Speculative decoding (decoder engine): ngram proposes, for each prompt, what followed its
    last few tokens earlier in the prompt and the answer (prompt lookup), verified in one forward:
    the same tokens, fewer forwards where the answer copies its input (editing code, answering
    from a document). Default: off."""
    num_speculative_tokens: int = 4
    """With --speculative: the most tokens proposed per step and prompt."""
    ngram_min: int = 2
    """With --speculative ngram: the shortest run of last tokens looked up."""
    ngram_max: int = 4
    """With --speculative ngram: the longest run of last tokens looked up (tried first)."""
    policy_off: Optional[str] = None
    """Rows of the engine's device policy table to switch off, comma-separated (ROW[,ROW]; the
    rows and why each is on: `onegpu doctor`)."""


@dataclass
class Completion:
    prompt: str
    text: str
    new_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False)
