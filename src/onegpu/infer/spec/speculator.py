"""Which decode rows speculate in a step, and how it went: the scheduler asks ``propose`` for each
decode sequence as it plans (its proposal is frozen in the plan), the engine hands each step's
outcome to ``record``.

A row proposes while its guesses pay: once its last ``window`` verifications kept fewer than
``min_accepted`` proposed tokens on average (a verifying forward of k + 1 positions costs more
than a plain decode step: below that the row is faster decoding plainly), it decodes plainly for
``pause`` tokens, then tries again; each pause in a row is twice the last (up to ``MAX_PAUSE``),
and a verification that pays resets it. A row with no proposal (no n-gram match) decodes plainly.
A request that asks for logprobs decodes plainly (its records are a decode step's)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from onegpu.infer.spec import Proposer
from onegpu.infer.spec.ngram import NgramProposer
from onegpu.infer.spec.verify import verify

FIRST_PAUSE, MAX_PAUSE = 8, 256


@dataclass
class SpecCounts:
    """vLLM's spec_decode counters: verifications run (``drafts``), tokens proposed and
    accepted, and accepted by position (index i: the proposals accepted at position i + 1)."""

    drafts: int = 0
    proposed: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    def totals(self) -> tuple:
        """As EngineStats' spec_drafts, spec_proposed, spec_accepted, spec_accepted_per_position."""
        return self.drafts, self.proposed, self.accepted, tuple(self.per_position)


@dataclass
class _Row:
    history: deque
    resume: int = 0  # the generated count from which the row proposes again
    pause: int = FIRST_PAUSE


class Speculator:
    """Proposals of at most ``k`` tokens from ``proposer`` (None: speculative decoding is off,
    ``on`` False, and nothing is proposed), cut by each request's grammar (``guides``:
    guided.Guides) and by its token budget."""

    def __init__(
        self, proposer: Optional[Proposer], k: int, min_accepted: float, window: int, guides
    ):
        self.proposer, self.k, self.guides = proposer, k, guides
        self.on = proposer is not None
        self.min_accepted, self.window = min_accepted, window
        self.counts = SpecCounts(per_position=[0] * k)
        self._rows: dict[int, _Row] = {}  # by request id
        # the grammar masks of this step's cut proposals, from planning: walked once, used by the
        # verification (an entry whose row did not speculate after all goes with the step)
        self._masks: dict = {}

    @classmethod
    def of(cls, config, guides) -> Speculator:
        """The Speculator an EngineConfig asks for (``speculative`` None: off)."""
        proposer = None
        if config.speculative == "ngram":
            proposer = NgramProposer(config.ngram_min, config.ngram_max)
        k = config.num_speculative_tokens
        return cls(proposer, k, config.spec_min_accepted, config.spec_window, guides)

    def propose(self, seq) -> tuple[int, ...]:
        """The tokens to verify for decode sequence ``seq`` this step (() : a plain decode row)."""
        if seq.params.logprobs is not None:
            return ()
        row = self._rows.setdefault(seq.id, _Row(deque(maxlen=self.window)))
        if seq.generated < row.resume:
            return ()
        # its last token is the target's: at most budget - 1 proposals, so that all may be kept
        k = min(self.k, seq.params.max_new_tokens - seq.generated - 1)
        if k <= 0:
            return ()
        guess = self.proposer.propose(seq.tokens, k)
        if guess and seq.params.constraint is not None:
            kept, self._masks[seq] = self.guides.walk(seq, guess)
            guess = guess[:kept]
        return tuple(guess)

    def verify(self, runner, rows, spec, adapters) -> list[tuple]:
        """``spec`` (Plan.spec) verified (verify.py), with the grammar masks their proposals were
        cut by: each sequence with its kept tokens."""
        masks, self._masks = self._masks, {}
        return verify(runner, rows, spec, adapters, masks) if spec else []

    def record(self, spec, tokens: dict, trim) -> None:
        """A step's speculative rows (Plan.spec) and the tokens each kept (by sequence): the counts
        and each row's history; ``trim`` (Scheduler.trim) gives each one's blocks past its tokens
        back."""
        c = self.counts
        for seq, guess in spec:
            trim(seq)
            new = tokens.get(seq, [])
            kept = 0
            while kept < min(len(new), len(guess)) and new[kept] == guess[kept]:
                c.per_position[kept] += 1
                kept += 1
            c.drafts += 1
            c.proposed += len(guess)
            c.accepted += kept
            row = self._rows.get(seq.id)
            if row is None:
                continue
            row.history.append(kept)
            if len(row.history) < self.window:
                continue
            if sum(row.history) / len(row.history) < self.min_accepted:
                row.resume = seq.generated + row.pause
                row.pause = min(2 * row.pause, MAX_PAUSE)
                row.history.clear()
            else:
                row.pause = FIRST_PAUSE

    def drop(self, seq) -> None:
        self._rows.pop(seq.id, None)
