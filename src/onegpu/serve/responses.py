"""What goes back to the caller, in OpenAI's formats: a finished completion or chat completion, or
its stream of server-sent-event chunks ending with ``data: [DONE]``. ``Tally`` gathers the engine's
updates for the choices of one request (text, tool calls, logprobs, finish reasons, token counts,
first-token time); ``Reply`` writes them out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Optional

CHAT, TEXT = "chat", "text"


@dataclass
class News:
    """What one update adds to one choice, ready to send."""

    text: str = ""
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: Optional[str] = None
    prompt_logprobs: Optional[list] = None  # with a choice's first token, when asked for

    def empty(self) -> bool:
        return not (self.text or self.calls or self.logprobs or self.finish)


@dataclass
class Tally:
    prompt_lengths: list  # tokens of each choice's prompt
    n: int  # choices per prompt: prompt tokens are counted once per prompt, as OpenAI does
    readers: Optional[list] = None  # per choice: tools.HermesReader / Llama3Reader, or None
    # completions' max_tokens 0 with echo: the token the engine drew is not the caller's
    score_only: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None

    def __post_init__(self):
        k = len(self.prompt_lengths)
        self.text, self.finish, self.generated = [""] * k, [None] * k, [0] * k
        self.calls: list[list] = [[] for _ in range(k)]
        self.logprobs: list[list] = [[] for _ in range(k)]
        self.prompt_logprobs: list[Optional[list]] = [None] * k

    @property
    def choices(self) -> int:
        return len(self.prompt_lengths)

    def add(self, index: int, update) -> News:
        if self.score_only:
            update = replace(update, token_ids=[], text="", logprobs=None, generated_tokens=0)
            update.finish_reason = (
                "length" if update.finish_reason == "stop" else update.finish_reason
            )
        text, calls = update.text, []
        reader = self.readers[index] if self.readers else None
        if reader is not None:
            text, calls = reader.feed(text)
            if update.finished:
                rest, more = reader.finish()
                text, calls = text + rest, calls + more
        news = News(text, calls, list(update.logprobs or []))
        if update.prompt_logprobs is not None:
            news.prompt_logprobs = self.prompt_logprobs[index] = update.prompt_logprobs
        self.text[index] += text
        self.calls[index] += calls
        self.logprobs[index] += news.logprobs
        self.generated[index] = update.generated_tokens
        if update.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if update.finished:
            reason = update.finish_reason
            self.finish[index] = "tool_calls" if self.calls[index] and reason == "stop" else reason
            news.finish = self.finish[index]
        return news

    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def usage(self) -> dict:
        prompt = sum(self.prompt_lengths[:: self.n])
        generated = sum(self.generated)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }


class Reply:
    """The fixed parts of one answer (its id, creation time, model name and kind).
    ``token_text``: a token id's text (for logprobs); ``echo``: each choice's prompt text, put
    before its answer (completions' echo); ``prompts``: each choice's prompt ids when the echoed
    prompt's logprobs were asked for (its first event then waits for them)."""

    def __init__(
        self,
        kind: str,
        model: str,
        token_text: Callable[[int], str] = str,
        echo: Optional[list] = None,
        continuous_usage: bool = False,
        prompts: Optional[list] = None,
    ):
        self.kind, self.model, self.token_text, self.echo = kind, model, token_text, echo
        self.continuous_usage, self.prompts = continuous_usage, prompts
        self.offsets: dict[int, int] = {}  # per choice: the text_offset of its next token
        prefix = "chatcmpl" if kind == CHAT else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, tally: Tally) -> dict:
        """The whole answer, for stream=false."""
        choices = [self._choice(tally, i) for i in range(tally.choices)]
        obj = "chat.completion" if self.kind == CHAT else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": tally.usage()}

    def _choice(self, tally: Tally, i: int) -> dict:
        logprobs = self.logprobs(tally.logprobs[i], i) if tally.logprobs[i] else None
        if self.prompts and tally.prompt_logprobs[i] is not None:
            logprobs = _joined(self.prompt_part(tally.prompt_logprobs[i], i), logprobs)
        if self.kind == CHAT:
            calls = tally.calls[i]
            message = {
                "role": "assistant",
                "content": tally.text[i] if tally.text[i] or not calls else None,
            }
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            return {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": tally.finish[i],
            }
        text = (self.echo[i] if self.echo else "") + tally.text[i]
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": tally.finish[i]}

    def opening(self, tally: Tally, index: int, prompt_logprobs=None) -> Optional[str]:
        """The first event of a choice: the chat's role, or the echoed prompt (with its tokens'
        logprobs when asked for: the caller waits for them, ``prompt_logprobs``)."""
        if self.kind == CHAT:
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}}
            return self._event(tally, {**choice, "logprobs": None, "finish_reason": None})
        if self.echo:
            part = self.prompt_part(prompt_logprobs, index) if prompt_logprobs else None
            choice = {"index": index, "text": self.echo[index], "logprobs": part}
            return self._event(tally, {**choice, "finish_reason": None})
        return None

    def prompt_part(self, items: list, index: int) -> dict:
        """The echoed prompt's tokens in a completion's logprobs: the first has none (nothing
        precedes it), as OpenAI's and vLLM's; offsets from the start of the text."""
        tokens = [self.token_text(t) for t in self.prompts[index]]
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [t.logprob for t in items[1:]],
            "top_logprobs": [None] + [self._top_by_text(t.top) for t in items[1:]],
            "text_offset": _offsets(tokens),
        }

    def chunk(self, tally: Tally, index: int, news: News) -> str:
        """One server-sent event with one choice's news."""
        logprobs = self.logprobs(news.logprobs, index) if news.logprobs else None
        if self.kind == CHAT:
            delta: dict = {"content": news.text} if news.text else {}
            if news.calls:
                delta["tool_calls"] = [
                    {"index": k, **c.openai()}
                    for k, c in enumerate(news.calls, len(tally.calls[index]) - len(news.calls))
                ]
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": news.text, "logprobs": logprobs}
        return self._event(tally, {**choice, "finish_reason": news.finish})

    def _event(self, tally: Tally, choice: dict) -> str:
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        body = {**self._head(obj), "choices": [choice]}
        if self.continuous_usage:
            body["usage"] = tally.usage()
        return event(body)

    def usage_chunk(self, tally: Tally) -> str:
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return event({**self._head(obj), "choices": [], "usage": tally.usage()})

    def logprobs(self, items: list, index: int) -> dict:
        """Engine TokenLogprobs of choice ``index`` in the endpoint's format. A completion's
        ``text_offset`` counts on from the choice's earlier tokens (after its echoed prompt), in
        a stream too: each token's place in the choice's whole text, as vLLM reports it."""
        if self.kind == CHAT:
            return {"content": [self._chat_logprob(t) for t in items]}
        tokens = [self.token_text(t.token_id) for t in items]
        start = self.offsets.get(index, len(self.echo[index]) if self.echo else 0)
        offsets = _offsets(tokens, start)
        self.offsets[index] = start + sum(len(t) for t in tokens)
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [self._top_by_text(t.top) for t in items],
            "text_offset": offsets,
        }

    def _top_by_text(self, top) -> dict:
        """Completions' top_logprobs map a token's text to its logprob: two tokens of one text
        (a tokenizer's byte fallbacks decode alike) keep the likelier, not the last one."""
        out: dict = {}
        for token_id, lp in top:
            out.setdefault(self.token_text(token_id), lp)
        return out

    def _chat_logprob(self, t) -> dict:
        def one(token_id: int, lp: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {**one(t.token_id, t.logprob), "top_logprobs": [one(i, lp) for i, lp in t.top]}


def _joined(prompt: dict, answer: Optional[dict]) -> dict:
    """A completion's logprobs: the echoed prompt's, then the answer's."""
    return {k: v + (answer[k] if answer else []) for k, v in prompt.items()}


def _offsets(tokens: list, at: int = 0) -> list:
    out = []
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
