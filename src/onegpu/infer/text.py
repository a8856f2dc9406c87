"""A request's output text as its tokens arrive: stop strings found across token boundaries, and
only text that is final handed out (not a half UTF-8 character, not the start of a stop string)."""

from __future__ import annotations

from typing import Optional


class TextTracker:
    """``tokenizer`` None: the caller wants token ids only; no text is made."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.shown = 0  # characters of ``text`` handed out so far
        self.stopped = False

    def add(self, ids: list[int]) -> None:
        """Take new tokens; after a stop string the text ends before it, and later tokens are
        ignored."""
        if self.stopped or not ids:
            return
        self.ids += ids
        if self.tokenizer is None:  # token ids only (GRPO's rollouts, benchmarks)
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            text, self.stopped = text[:cut], True
        self.text = text

    def _stop_at(self, text: str) -> Optional[int]:
        start = max(0, self.shown - self.hold)  # a stop string may begin in text not yet shown
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def take(self, final: bool) -> str:
        """Text not handed out before that is final (all of it when the request has ended)."""
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.shown and self.text[end - 1] == "\ufffd":  # half a character
                end -= 1
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown : end], end
        return out
