"""What goes back to the caller, in OpenAI's formats: a finished completion or chat completion, or
its stream of server-sent-event chunks ending with ``data: [DONE]``. ``Tally`` gathers the engine's
updates for the choices of one request (text, finish reasons, token counts, first-token time)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

CHAT, TEXT = "chat", "text"


@dataclass
class Tally:
    choices: int
    n: int  # choices per prompt: prompt tokens are counted once per prompt, as OpenAI does
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    text: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    prompt: list = field(default_factory=list)

    def __post_init__(self):
        k = self.choices
        self.text, self.finish, self.generated, self.prompt = [""] * k, [None] * k, [0] * k, [0] * k

    def add(self, index: int, update) -> None:
        self.text[index] += update.text
        self.generated[index] = update.generated_tokens
        if update.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if update.finished:
            self.finish[index] = update.finish_reason
            self.prompt[index] = update.prompt_tokens

    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def usage(self) -> dict:
        prompt = sum(self.prompt[:: self.n])
        generated = sum(self.generated)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }


class Reply:
    """The fixed parts of one answer (its id, creation time, model name and kind)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        prefix = "chatcmpl" if kind == CHAT else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, tally: Tally) -> dict:
        """The whole answer, for stream=false."""
        if self.kind == CHAT:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(zip(tally.text, tally.finish, strict=True))
            ]
            return {**self._head("chat.completion"), "choices": choices, "usage": tally.usage()}
        choices = [
            {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            for i, (text, reason) in enumerate(zip(tally.text, tally.finish, strict=True))
        ]
        return {**self._head("text_completion"), "choices": choices, "usage": tally.usage()}

    def chunk(self, index: int, text: str, finish: Optional[str], role: bool = False) -> str:
        """One server-sent event with one choice's news (``role``: the chat stream's opening)."""
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            if finish and not text:
                delta = {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return event({**self._head("chat.completion.chunk"), "choices": [choice]})
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return event({**self._head("text_completion"), "choices": [choice]})

    def usage_chunk(self, tally: Tally) -> str:
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return event({**self._head(obj), "choices": [], "usage": tally.usage()})


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
