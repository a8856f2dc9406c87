"""Timing one generation call of `onegpu bench infer`: transformers' ``generate`` (stamped by a
streamer) or the decode engine (stamped at each ``step``), and the memory the call used on CUDA.

Both give: time to first token, prefill tokens/s (prompt tokens / time to first token), ms per
decode step (one new token for every row) and decode tokens/s (rows / step time), measured over the
steps after the first token arrived.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


class Memory:
    """Allocated-memory readings on CUDA (None elsewhere: a CPU's allocator keeps no such count)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.before = 0

    def allocated(self) -> Optional[int]:
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

    def rise(self) -> Optional[int]:
        """How far allocated memory rose above its level at start()."""
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.before


class _Clock:
    """A generate() streamer that only timestamps: put() is called with the prompt, then once per
    new token. On CUDA it synchronises first, so each stamp is when the token really exists."""

    def __init__(self, device: str):
        self.sync = _sync(device)
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.sync()
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _run(batch: int, prompt_len: int, start: float, first: float, decode_s, steps: int) -> dict:
    ms = 1000 * decode_s / steps if steps > 0 else None
    return {
        "ttft_ms": 1000 * (first - start),
        "prefill_tps": batch * prompt_len / (first - start),
        "ms_per_step": ms,
        "decode_tps": batch * 1000 / ms if ms else None,
        "decode_steps_timed": steps,
        "load1": os.getloadavg()[0],
    }


def time_generate(model, inputs: dict, kwargs: dict, device: str) -> tuple[dict, Any]:
    """One ``model.generate`` call: its timings, and the new tokens [batch, new]."""
    import torch

    batch, prompt_len = inputs["input_ids"].shape
    new = kwargs["max_new_tokens"]
    memory = Memory(device)
    memory.start()
    clock = _Clock(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **kwargs, min_new_tokens=new, streamer=clock)
    first, last = clock.stamps[1], clock.stamps[-1]
    run = _run(batch, prompt_len, start, first, last - first, new - 1)
    run["mem_rise"] = memory.rise()
    return run, out[:, prompt_len:]


def time_engine(engine, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[dict, Any]:
    """One batch through the decode engine, every request exactly ``new_tokens`` long (EOS
    ignored): its timings, and the new tokens [batch, new].

    The first token of a request arrives with the engine step that computed the last piece of its
    prompt: that is its time to first token, as a streaming client sees it. The decode time is the
    time after every request's first token arrived."""
    import torch

    from onegpu.infer.requests import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    memory = Memory(device)
    memory.start()
    start = time.perf_counter()
    ids = [engine.submit(list(p), params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    first = None
    after_first = 0  # tokens per request once every first token has arrived
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            tokens[u.request_id] += u.token_ids
        if first is None and all(tokens[i] for i in ids):
            first, after_first = now, min(len(tokens[i]) for i in ids)
    end = time.perf_counter()
    run = _run(len(prompts), len(prompts[0]), start, first, end - first, new_tokens - after_first)
    run["mem_rise"] = memory.rise()
    return run, torch.tensor([tokens[i] for i in ids])
