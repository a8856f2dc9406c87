"""``generate`` on the decode engine: the prompts become requests of one engine whose KV pool is
sized to them (``batch_size`` rows of the longest prompt + new tokens, in 64-token steps), decoded
together; a prompt takes the next free row as soon as one finishes (continuous batching), and
prompts that share a prefix compute it once (the prefix cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.images import PromptImages
from onegpu.infer.policy import parse_off
from onegpu.infer.requests import Result, SamplingParams

if TYPE_CHECKING:
    from onegpu.infer.sampling_config import SamplingConfig


def engine_generate(
    model,
    tokenizer,
    ids: list[list[int]],
    scfg: SamplingConfig,
    max_new: int,
    on_text: Optional[Callable[[str], None]] = None,
    images: Optional[list[Optional[PromptImages]]] = None,
) -> list[Result]:
    """``images``: each prompt's images (a vision-language model's), or None."""
    engine = Engine(model, tokenizer, generate_config(scfg, ids, max_new))
    params = [request_params(scfg, max_new, i) for i in range(len(ids))]
    return run_requests(engine, ids, params, images, on_text)


def generate_config(scfg: SamplingConfig, ids: list[list[int]], max_new: int) -> EngineConfig:
    """The engine of one ``generate`` call: rows for the batch, positions for the longest."""
    need = -(-(max(map(len, ids)) + max_new) // 64) * 64
    compile_ = "auto" if scfg.compile == "auto" else ("off" if scfg.compile == "off" else "on")
    return EngineConfig(
        max_slots=min(scfg.batch_size, len(ids)),
        max_len=need,
        compile=compile_,
        compile_mode=None if scfg.compile in ("auto", "off") else scfg.compile,
        compile_backend=scfg.compile_backend,
        policy_off=parse_off(scfg.policy_off),
        speculative=scfg.speculative,
        num_speculative_tokens=scfg.num_speculative_tokens,
        ngram_min=scfg.ngram_min,
        ngram_max=scfg.ngram_max,
    )


def request_params(scfg: SamplingConfig, max_new: int, index: int) -> SamplingParams:
    """The engine's settings for prompt ``index``: its own seed (scfg.seed + index), so equal
    prompts sample different completions and a rerun reproduces each."""
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=0.0 if scfg.greedy else scfg.temperature,
        top_k=scfg.top_k,
        top_p=scfg.top_p,
        repetition_penalty=scfg.repetition_penalty,
        seed=scfg.seed + index,
        stop=tuple(scfg.stop),
    )


def run_requests(engine: Engine, ids, params, images=None, on_text=None) -> list[Result]:
    """Like ``engine.generate``, with each prompt's images (or None), handing each update's text
    to ``on_text`` as it comes."""
    images = images or [None] * len(ids)
    rids = [engine.submit(p, s, images=i) for p, s, i in zip(ids, params, images, strict=True)]
    tokens = {r: [] for r in rids}
    texts = {r: "" for r in rids}
    done: dict[int, Result] = {}
    while engine.has_work():
        for u in engine.step():
            tokens[u.request_id] += u.token_ids
            texts[u.request_id] += u.text
            if u.text and on_text is not None:
                on_text(u.text)
            if u.finished:
                done[u.request_id] = Result(
                    tokens[u.request_id], texts[u.request_id], u.finish_reason, u.prompt_tokens
                )
    return [done[r] for r in rids]
