"""An engine that answers from a script, for the server's in-process tests: each request's answer is
``script(prompt_text, params)`` tokenized with the real tokenizer and handed back one token a step,
through the engine's real Output (incremental detokenization, stop strings, held-back text). A
script answer of ``FAIL`` fails that request alone (Update.error); ``CRASH`` makes the step raise
(an engine-wide fault). It implements
the engine's side of the serve scheduler (submit, cancel, step, has_work, stats, free_slots) and
logprobs of fixed values, so the server's rendering of them is tested apart from the engine's
(tests/test_serve.py checks the real engine's). The server runs under uvicorn on a thread, on
127.0.0.1 and a free port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from onegpu.infer.engine import EngineStats
from onegpu.infer.output import Output
from onegpu.infer.requests import EngineFeatures, TokenLogprob, Update
from serve_support import free_port

FAIL, CRASH = "<<fail>>", "<<crash>>"


@dataclass
class _Seq:
    id: int
    prompt: list
    params: object
    answer: list
    tracker: Output
    fail: bool = False
    generated: int = 0
    cancelled: bool = False


@dataclass
class ScriptedEngine:
    tokenizer: object
    script: Callable[[str, object], str]
    max_slots: int = 4
    max_len: int = 512
    step_s: float = 0.0  # pause per step (a slow engine, for timing-dependent tests)
    seen: list = field(default_factory=list)  # (prompt text, params) of each submitted request

    def __post_init__(self):
        self._seqs: list[_Seq] = []
        self._next = 0

    def submit(self, prompt_ids, params, adapter=None, images=None) -> int:
        params.check()
        text = self.tokenizer.decode(prompt_ids)
        self.seen.append((text, params))
        answer = self.script(text, params)
        ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        seq = _Seq(self._next, list(prompt_ids), params, ids, Output(self.tokenizer, params.stop))
        seq.fail = answer == FAIL
        self._next += 1
        self._seqs.append(seq)
        return seq.id

    def cancel(self, rid: int) -> None:
        for s in self._seqs:
            if s.id == rid:
                s.cancelled = True

    def has_work(self) -> bool:
        return bool(self._seqs)

    def stats(self) -> EngineStats:
        used = sum(len(s.prompt) + s.generated for s in self._seqs)
        return EngineStats(len(self._seqs), 0, used, self.max_slots * self.max_len)

    def free_slots(self) -> int:
        return max(0, self.max_slots - len(self._seqs))

    def step(self, arrived=None) -> list:
        time.sleep(self.step_s)
        if any(self.tokenizer.decode(s.answer) == CRASH and not s.cancelled for s in self._seqs):
            raise RuntimeError("injected engine fault")
        updates = [self._advance(s) for s in self._seqs]
        self._seqs = [
            s for s in self._seqs if not any(u.request_id == s.id and u.finished for u in updates)
        ]
        return updates

    def _advance(self, s: _Seq) -> Update:
        if s.cancelled:
            return Update(s.id, [], "", True, "cancelled", len(s.prompt), s.generated)
        if s.fail:
            return Update(s.id, [], "", True, "error", len(s.prompt), 0, error="injected fault")
        eos = s.generated >= len(s.answer)
        token = self.tokenizer.eos_token_id if eos else s.answer[s.generated]
        s.generated += 1
        if not eos:
            s.tracker.add([token])
        stop = eos or s.tracker.stopped
        done = stop or s.generated >= s.params.max_new_tokens
        reason = "stop" if stop else "length"
        logprobs = None
        if s.params.logprobs is not None:
            top = tuple((token + k, -0.25 * (k + 1)) for k in range(s.params.logprobs))
            logprobs = [TokenLogprob(token, -0.25, top)]
        prompt_logprobs = None
        if s.params.prompt_logprobs is not None and s.generated == 1:  # each prompt token -0.5
            k = s.params.prompt_logprobs
            prompt_logprobs = [None] + [
                TokenLogprob(t, -0.5, tuple((t + j, -0.5 * (j + 1)) for j in range(k)))
                for t in s.prompt[1:]
            ]
        return Update(
            s.id,
            [token],
            s.tracker.take(final=done),
            done,
            reason if done else None,
            len(s.prompt),
            s.generated,
            s.generated == 1,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


ALL_FEATURES = EngineFeatures(penalties=True, logprobs=True, constraints=True)


class LiveApp:
    """build_app(service) under uvicorn on a thread: ``url``; ``stop()``."""

    def __init__(self, service):
        import uvicorn

        from onegpu.serve.app import build_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(service), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_service(
    tokenizer,
    script,
    features: Optional[EngineFeatures] = None,
    tool_format: Optional[str] = None,
    api_key: Optional[str] = None,
    **engine_kw,
):
    """A Service around a ScriptedEngine (returned too), as launch.serve builds the real one."""
    from onegpu.serve.adapters import ServedModels
    from onegpu.serve.app import Service
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler

    engine = ScriptedEngine(tokenizer, script, **engine_kw)
    metrics = Metrics()
    service = Service(
        Scheduler(engine, 8, metrics),
        tokenizer,
        ServedModels("tiny"),
        metrics,
        engine.max_len,
        api_key=api_key,
        features=features or EngineFeatures(),
        tool_format=tool_format,
    )
    return service, engine
