"""The decode engine's side of structured output: each constrained request's matcher (its place in
its grammar, ``infer.constraints``), the token masks of the rows a step samples, and each sampled
token handed back to its grammar.

Per engine step: ``fill`` writes the allowed next tokens of each constrained row the step samples
(decode rows, and prompts whose first token it draws) into the sampler's host bitmask, puts the
rows that held a mask before back to all ones, and uploads the rows it wrote; the sampler applies
the mask on the device where ``Needs.constraints`` (``sampling.next_tokens``). After the
read-back, ``accept`` advances each constrained request's matcher by its new token. The engine
runs one token a step while a constrained request runs (``Scheduler.schedule``), so the host has
seen each token before the next one is drawn."""

from __future__ import annotations

from typing import Optional

from onegpu.infer.constraints import ConstraintError, Grammars, Matcher
from onegpu.infer.sampling import Sampler
from onegpu.infer.scheduler import Sequence


class Guides:
    """The matchers of one engine's constrained requests, by request id. ``grammars``: the
    compiler, made at the first constrained request (preparing a tokenizer takes seconds at a 128k
    vocabulary: an engine never asked for a grammar does not pay it); a caller may set its own."""

    def __init__(self, tokenizer, vocab: int, sampler: Sampler):
        self.tokenizer, self.vocab, self.sampler = tokenizer, vocab, sampler
        self.grammars: Optional[Grammars] = None
        self.matchers: dict[int, Matcher] = {}
        self.masked: set[int] = set()  # rows whose host bitmask holds a grammar's mask

    def start(self, seq: Sequence) -> None:
        """``seq`` took a row. Its matcher is made at its first admission; a request computed
        again after preemption keeps the one that has accepted its output. A grammar that does
        not compile raises ConstraintError: that request's failure alone."""
        constraint = seq.params.constraint
        if constraint is None or seq.id in self.matchers:
            return
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.vocab)
        self.matchers[seq.id] = self.grammars.matcher(constraint)

    def fill(self, seqs: list[Sequence], failed: dict) -> None:
        """The masks of the constrained ``seqs`` (the rows this step samples) on the device, every
        other row all ones. A matcher that raises fails its request (into ``failed``)."""
        host, marks = self.sampler.host_bitmask, self.sampler.host_masked
        touched = set(self.masked)
        for row in self.masked:
            host[row].fill_(-1)
            marks[row] = False
        self.masked = set()
        for seq in seqs:
            matcher = self.matchers.get(seq.id)
            if matcher is None or seq in failed:
                continue
            try:
                matcher.fill_bitmask(host, seq.row)
            except Exception as exc:  # noqa: BLE001 - this request's grammar: it alone fails
                failed[seq] = exc
                host[seq.row].fill_(-1)
                continue
            marks[seq.row] = True
            self.masked.add(seq.row)
            touched.add(seq.row)
        if touched:
            self.sampler.upload_bitmask(max(touched) + 1)

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
        """``seq`` ended: its matcher goes (its row's mask is reset by the next ``fill``)."""
        self.matchers.pop(seq.id, None)
