"""The decode engine's side of structured output: each constrained request's matcher (its place in
its grammar, ``infer.constraints``), the token masks of the rows a step samples, and each sampled
token handed back to its grammar.

Per engine step: ``masks`` gives the allowed next tokens of each constrained row the step samples
(decode rows, and prompts whose first token it draws); the engine's rows take them
(``Rows.set_masks``: every other row all ones) and the sampler applies them on the device where
``Needs.constraints`` (``sampling.next_tokens``). After the read-back, ``accept`` advances each
constrained request's matcher by its new token. The engine runs one token a step while a
constrained request runs (``Scheduler.schedule``), so the host has seen each token before the next
one is drawn."""

from __future__ import annotations

from typing import Optional

import torch

from onegpu.infer.constraints import ConstraintError, Grammars, Matcher
from onegpu.infer.logit_rules import bitmask_words
from onegpu.infer.scheduler import Sequence


class Guides:
    """The matchers of one engine's constrained requests, by request id. ``grammars``: the
    compiler a caller gives (a server's, which checks requests as they arrive: they compile the
    same here), else made at the first constrained request (preparing a tokenizer takes seconds
    at a 128k vocabulary: an engine never asked for a grammar does not pay it). The masks are
    written into a buffer of its own and handed to the engine's rows (rows.Rows.set_masks)."""

    def __init__(self, tokenizer, vocab: int, rows: int, grammars: Optional[Grammars] = None):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.grammars = grammars
        self.matchers: dict[int, Matcher] = {}
        self.rows = rows
        self._bits: Optional[torch.Tensor] = None  # [rows, words] int32, made at the first mask

    def start(self, seqs: list[Sequence]) -> dict:
        """``seqs`` took a row. A matcher is made at a request's first admission; a request
        computed again after preemption keeps the one that has accepted its output. A grammar
        that does not compile is that request's failure alone: the failures, by sequence."""
        failed = {}
        for seq in seqs:
            constraint = seq.params.constraint
            if constraint is None or seq.id in self.matchers:
                continue
            try:
                if self.grammars is None:
                    self.grammars = Grammars(self.tokenizer, self.vocab)
                self.matchers[seq.id] = self.grammars.matcher(constraint)
            except Exception as exc:  # noqa: BLE001 - this request's grammar: it alone fails
                failed[seq] = exc
        return failed

    def masks(self, seqs: list[Sequence]) -> tuple[dict, dict]:
        """The allowed next tokens of the constrained ``seqs`` (the rows this step samples), as
        ``{row: bitmask row}``, and the sequences whose matcher raised, with their errors."""
        masks, failed = {}, {}
        for seq in seqs:
            matcher = self.matchers.get(seq.id)
            if matcher is None:
                continue
            if self._bits is None:
                self._bits = torch.full(
                    (self.rows, bitmask_words(self.vocab)), -1, dtype=torch.int32
                )
            try:
                matcher.fill_bitmask(self._bits, seq.row)
            except Exception as exc:  # noqa: BLE001 - this request's grammar: it alone fails
                failed[seq] = exc
                continue
            masks[seq.row] = self._bits[seq.row]
        return masks, failed

    def walk(self, seq: Sequence, tokens: list[int]) -> tuple[int, Optional[torch.Tensor]]:
        """A speculative row's proposal through its grammar: how many of ``tokens`` it allows in
        a row (cut before one it refuses, and before one that would complete it: the request's
        end is the target's token, as in plain decoding), and the mask of each position of that
        cut proposal and the one after it ``[kept + 1, words]``; the matcher is rolled back. (all,
        None) for a request without a grammar."""
        matcher = self.matchers.get(seq.id)
        if matcher is None:
            return len(tokens), None
        bits = torch.full((len(tokens) + 1, bitmask_words(self.vocab)), -1, dtype=torch.int32)
        kept = 0
        for i, token in enumerate(tokens):
            matcher.fill_bitmask(bits, i)
            word = int(bits[i, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1 or not matcher.accept(token):
                break
            kept += 1
            if matcher.terminated():
                matcher.rollback(1)
                kept -= 1
                break
        matcher.fill_bitmask(bits, kept)
        if kept:
            matcher.rollback(kept)
        return kept, bits[: kept + 1]

    def accept(self, seq: Sequence, tokens: list[int]) -> bool:
        """Advance ``seq``'s matcher by its new ``tokens``; True when its grammar is complete
        (nothing but EOS may follow: the request ends). A token the grammar does not allow (the
        mask lets none through; only a fault would) raises ConstraintError."""
        matcher = self.matchers.get(seq.id)
        if matcher is None:
            return False
        for token in tokens:
            if not matcher.accept(token):
                why = (getattr(matcher, "error", lambda: None)() or "").split("\n")[0]
                raise ConstraintError(
                    f"the request's grammar does not allow the sampled token {token}"
                    + (f": {why}" if why else "")
                )
        return matcher.terminated()

    def drop(self, seq: Sequence) -> None:
        """``seq`` ended: its matcher goes (its row's mask is reset by the next step's masks)."""
        self.matchers.pop(seq.id, None)
