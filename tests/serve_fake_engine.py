"""A stand-in with the decode engine's contract (onegpu.infer.engine.Engine), used by the server's
tests until the engine itself lands: one sequence at a time with its own DynamicCache, greedy or
seeded sampling, stop strings held back, PEFT adapters chosen per request, slots and a waiting line.
`python tests/serve_fake_engine.py <onegpu serve flags>` runs `onegpu serve` on it."""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from onegpu.errors import ConfigError
from onegpu.infer.requests import SamplingParams, Update


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_positions_used: int
    kv_positions_total: int


@dataclass
class _Seq:
    rid: int
    prompt: list
    params: SamplingParams
    adapter: Optional[str]
    tokens: list = field(default_factory=list)
    sent: str = ""
    cache: object = None
    logits: object = None
    generator: object = None


class FakeEngine:
    def __init__(self, model, tokenizer, max_len: int, max_slots: int, sync_every: int = 8):
        self.model, self.tokenizer = model, tokenizer
        self.max_len, self.max_slots, self.sync_every = max_len, max_slots, sync_every
        self._waiting: deque = deque()
        self._running: dict[int, _Seq] = {}
        self._cancelled: set[int] = set()
        self._next = 0

    def submit(self, prompt_ids, params: SamplingParams, adapter=None) -> int:
        params.check()
        if len(prompt_ids) + params.max_new_tokens > self.max_len:
            raise ConfigError(f"prompt + max_new_tokens is over max_len {self.max_len}.")
        if adapter is not None and adapter not in getattr(self.model, "peft_config", {}):
            raise ConfigError(f"unknown adapter '{adapter}'.")
        self._next += 1
        self._waiting.append(_Seq(self._next, list(prompt_ids), params, adapter))
        return self._next

    def cancel(self, rid: int) -> None:
        self._cancelled.add(rid)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._cancelled)

    def stats(self) -> EngineStats:
        used = sum(len(s.prompt) + len(s.tokens) for s in self._running.values())
        return EngineStats(
            len(self._running), len(self._waiting), used, self.max_slots * self.max_len
        )

    def step(self) -> list[Update]:
        updates = self._drop_cancelled()
        while self._waiting and len(self._running) < self.max_slots:
            seq = self._waiting.popleft()
            self._running[seq.rid] = seq
        for seq in list(self._running.values()):
            updates.append(self._decode(seq))
        return updates

    def _drop_cancelled(self) -> list[Update]:
        out = []
        for rid in self._cancelled:
            gone = self._running.pop(rid, None)
            waiting = [s for s in self._waiting if s.rid == rid]
            for s in waiting:
                self._waiting.remove(s)
            seq = gone or (waiting[0] if waiting else None)
            if seq is not None:
                out.append(Update(rid, [], "", True, "cancelled", len(seq.prompt), len(seq.tokens)))
        self._cancelled.clear()
        return out

    @torch.inference_mode()
    def _decode(self, seq: _Seq) -> Update:
        first = not seq.tokens
        new: list[int] = []
        finish = None
        with self._adapter(seq.adapter):
            if seq.cache is None:
                self._forward(seq, seq.prompt)
            for _ in range(self.sync_every):
                token = self._pick(seq)
                seq.tokens.append(token)
                new.append(token)
                finish = self._finished(seq, token)
                if finish:
                    break
                self._forward(seq, [token])
        text, stop_hit = self._text(seq, final=finish is not None)
        finish = "stop" if stop_hit else finish
        if finish:
            del self._running[seq.rid]
        return Update(
            seq.rid, new, text, finish is not None, finish, len(seq.prompt), len(seq.tokens), first
        )

    def _adapter(self, name):
        import contextlib

        if not hasattr(self.model, "peft_config"):
            return contextlib.nullcontext()
        if name is None:
            return self.model.disable_adapter()
        self.model.set_adapter(name)
        return contextlib.nullcontext()

    def _forward(self, seq: _Seq, ids: list[int]) -> None:
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=seq.cache, use_cache=True)
        seq.cache, seq.logits = out.past_key_values, out.logits[0, -1].float()

    def _pick(self, seq: _Seq) -> int:
        p = seq.params
        if p.greedy:
            return int(seq.logits.argmax())
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(p.seed)
        probs = torch.softmax(seq.logits / p.temperature, -1)
        ordered, index = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < p.top_p
        ordered = ordered * keep
        return int(index[torch.multinomial(ordered, 1, generator=seq.generator)])

    def _finished(self, seq: _Seq, token: int):
        if token == self.tokenizer.eos_token_id and not seq.params.ignore_eos:
            return "stop"
        if len(seq.tokens) >= seq.params.max_new_tokens:
            return "length"
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return "stop" if any(stop in text for stop in seq.params.stop) else None

    def _text(self, seq: _Seq, final: bool) -> tuple[str, bool]:
        """The text that may be shown now, beyond what was sent; whether a stop string came."""
        full = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        cuts = [i for i in (full.find(s) for s in seq.params.stop) if i >= 0]
        if cuts:
            full, final = full[: min(cuts)], True
        elif not final:
            full = _hold_back(full, seq.params.stop)
        delta = full[len(seq.sent) :] if len(full) >= len(seq.sent) else ""
        seq.sent += delta
        return delta, bool(cuts)


def _hold_back(text: str, stops) -> str:
    if text.endswith("\ufffd"):
        text = text[:-1]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return text[:-k]
    return text


def kv_bytes_per_position(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def kit():
    from onegpu.serve.launch import EngineKit

    def make(model, tokenizer, plan, cfg):
        return FakeEngine(model, tokenizer, plan.max_len, plan.max_slots, cfg.sync_every)

    return EngineKit(make, kv_bytes_per_position)


if __name__ == "__main__":
    from onegpu.cli.main import run_command
    from onegpu.cli.serve import cli

    sys.exit(run_command(lambda: cli(sys.argv[1:], kit=kit())))
