"""Speculative decoding: a proposer guesses a decode row's next tokens on the host, the engine
verifies them in one forward over the paged KV (verify.py) and keeps the longest prefix the
target agrees with plus one token of its own (sampling.speculative_accept).

- ``Proposer``: ``propose(tokens, k)`` -> up to ``k`` guessed tokens after ``tokens`` (prompt and
  output so far). ``ngram.py``: prompt lookup, no second model.
- ``speculator.py``: which rows propose this step (adaptive per row: a row whose guesses are
  rarely accepted decodes plainly for a while), the counts (EngineStats' ``spec_*``).
- ``verify.py``: the verifying forward, the target's tokens at every position under the row's
  own sampling settings, acceptance, the rows' state after it.
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (none: the row decodes plainly)."""
        ...
