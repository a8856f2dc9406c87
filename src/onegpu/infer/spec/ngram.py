"""Prompt-lookup proposals (n-gram): the tokens that followed the most recent earlier occurrence
of the context's last n tokens, n from ``ngram_max`` down to ``ngram_min`` (transformers'
``prompt_lookup_num_tokens``, vLLM's ``ngram``). Host side, over the prompt and the tokens
generated so far; no model, no device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    ngram_min: int = 2
    """The shortest suffix looked up."""
    ngram_max: int = 4
    """The longest suffix looked up (tried first: a longer match predicts better)."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix
        of ``tokens`` (``ngram_max`` tokens down to ``ngram_min``) that occurs before; [] when none
        does."""
        if k <= 0 or len(tokens) <= self.ngram_min:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # windows starting at i for i + n < len(tokens): each has a token after it, and the
            # suffix itself is not among them
            windows = sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []
