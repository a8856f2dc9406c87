"""A request's output as its tokens arrive: text decoded incrementally (each token once, not the
whole answer again at every read-back), stop strings found across token boundaries, and only text
that is final handed out (not half a UTF-8 character, not the start of a stop string). The last
stage of the engine's flow: it turns the tokens of a step into the callers' ``Update``, and it
holds the request's end — the device's (an end token, the budget: rows.Rows.ended, read back as a
code) with what only the host knows (a stop string, a complete grammar)."""

from __future__ import annotations

from typing import Optional

from onegpu.infer.requests import FinishReason, TokenLogprob, Update
from onegpu.infer.rows import finish_reason


class Detokenizer:
    """Token ids -> text, one token at a time. With a fast tokenizer, ``tokenizers``'
    ``DecodeStream`` (it holds a token back while it ends in half a character); otherwise the
    window of tokens since the last whitespace is decoded again (transformers' TextStreamer).
    ``DecodeStream`` raises on some runs of a SentencePiece tokenizer's byte-fallback tokens under
    its Metaspace decoder (Llama 2's, Mistral's: "Invalid prefix encountered"), which failed the
    request; from there on the request decodes as vLLM's incremental detokenizer does: the new
    tokens with a few before them for context, less the context's own text."""

    CONTEXT = 5  # tokens decoded before the new ones: enough for a word's leading space

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend else None
        self.pending: list[int] = []  # tokens since the last text came out
        self.window: list[int] = []  # the slow path's tokens since its last whitespace
        self.window_text = ""
        self.tokens: list[int] = []  # every token (the context after a refusal)
        self.offsets: Optional[tuple[int, int]] = None  # after a refusal: context, unread

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if self.offsets is not None:
            return self._read(final=False)
        if self.stream is not None:
            try:
                piece = self.stream.step(self.backend, token)
            except Exception:  # noqa: BLE001 - tokenizers' own error type is not exported
                unread = len(self.tokens) - 1 - len(self.pending)
                self.stream, self.pending = None, []
                self.offsets = (max(0, unread - self.CONTEXT), unread)
                return self._read(final=False)
            self.pending = [] if piece else self.pending + [token]
            return piece or ""
        self.window.append(token)
        text = self.tokenizer.decode(self.window, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return ""
        new, self.window_text = text[len(self.window_text) :], text
        if text.endswith((" ", "\n")):
            self.window, self.window_text = [], ""
        return new

    def _read(self, final: bool) -> str:
        context, unread = self.offsets
        decode = self.tokenizer.decode
        before = decode(self.tokens[context:unread], skip_special_tokens=True)
        text = decode(self.tokens[context:], skip_special_tokens=True)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.offsets = (max(unread, len(self.tokens) - self.CONTEXT), len(self.tokens))
        return text[len(before) :]

    def flush(self) -> str:
        """At the end: what is held back (bytes that never completed a character) as the full
        decode would show it."""
        if self.offsets is not None:
            return self._read(final=True)
        if self.stream is None:
            text = self.tokenizer.decode(self.window, skip_special_tokens=True)
            return text[len(self.window_text) :]
        held, self.pending = self.pending, []
        return self.tokenizer.decode(held, skip_special_tokens=True) if held else ""


class Output:
    """One request's text. ``tokenizer`` None: the caller wants token ids only; no text is
    made."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.stops = stops
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.shown = 0  # characters of ``text`` handed out so far
        self.stopped = False
        self.prompt_logprobs: list = [None]  # when asked: the first token's is None

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Logprobs of the prompt's tokens from index ``first`` on; those held already (a prompt
        computed again after preemption) are not repeated."""
        self.prompt_logprobs += entries[max(0, len(self.prompt_logprobs) - first) :]

    def reason(self, code: int, complete: bool) -> Optional[FinishReason]:
        """Why the request ends now (None: it goes on): its text reached a stop string, its
        grammar is complete (only EOS may follow: it ends a step early, and ``ignore_eos`` cannot
        hold it in a mask of EOS alone), or its row stopped on the device (``code``)."""
        if self.stopped or complete:
            return "stop"
        return finish_reason(code)

    def add(self, ids: list[int]) -> None:
        """Take new tokens; after a stop string the text ends before it, and later tokens are
        ignored."""
        if self.stopped or self.detok is None:
            return
        for token in ids:
            self.text += self.detok.add(token)
            cut = self._stop_at()
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return

    def _stop_at(self) -> Optional[int]:
        if not self.stops:
            return None
        start = max(0, self.shown - self.hold)  # a stop string may begin in text not yet shown
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def take(self, final: bool) -> str:
        """Text not handed out before that is final (all of it when the request has ended)."""
        if final and not self.stopped and self.detok is not None:
            self.text += self.detok.flush()
            cut = self._stop_at()
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
        end = len(self.text)
        if not final:
            end -= self.hold
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown : end], end
        return out


def update(
    request_id: int,
    output: Output,
    tokens: list[int],
    reason: Optional[FinishReason],
    prompt_tokens: int,
    generated: int,
    first: bool,
    logprobs: Optional[list] = None,
    prompt_logprobs: Optional[list] = None,
) -> Update:
    """The news of one request after a step: its new tokens, the text now final, its end."""
    return Update(
        request_id,
        tokens,
        output.take(final=reason is not None),
        reason is not None,
        reason,
        prompt_tokens,
        generated,
        first,
        logprobs,
        prompt_logprobs,
    )


def unpack_logprobs(values: list[float], top: int, rows: list[tuple]) -> dict:
    """``values``: for each ``(sequence, its tokens read back, steps)`` of ``rows``, ``steps``
    records of ``1 + 2 * top`` numbers (the token's logprob, the top ids, their logprobs); one
    TokenLogprob per token read back (the first ones: a row's live steps come first), its top cut
    to the request's own k."""
    out, at, width = {}, 0, 1 + 2 * top
    for seq, tokens, steps in rows:
        k = seq.params.logprobs
        got = []
        for j, token in enumerate(tokens):
            rec = values[at + j * width : at + (j + 1) * width]
            alternatives = zip(rec[1 : 1 + k], rec[1 + top : 1 + top + k], strict=True)
            got.append(TokenLogprob(token, rec[0], tuple((int(i), lp) for i, lp in alternatives)))
        out[seq] = got
        at += steps * width
    return out


def logprobs_of(back, decode, steps: int, top: int) -> dict:
    """Each asking sequence's TokenLogprobs from a step's read-back (rows.ReadBack): the decode
    rows' records first, then the firsts'."""
    asking = [s for s in decode if s.params.logprobs is not None]
    found = unpack_logprobs(back.values, top, [(s, back.tokens[s], steps) for s in asking])
    rest = back.values[len(asking) * steps * (1 + 2 * top) :]
    firsts = [(s, t, 1) for s, t in back.firsts.items() if s.params.logprobs is not None]
    found.update(unpack_logprobs(rest, top, firsts))
    return found
