"""The n-gram proposer: the longest suffix first, the most recent earlier match, at most k
tokens, nothing without a match."""

from __future__ import annotations

from onegpu.infer.spec.ngram import NgramProposer


def test_proposes_what_followed_the_most_recent_match():
    # "1 2" occurs at 0 (followed by 3 4) and at 5 (followed by 9 8): the most recent wins
    tokens = [1, 2, 3, 4, 7, 1, 2, 9, 8, 6, 1, 2]
    assert NgramProposer(2, 2).propose(tokens, 2) == [9, 8]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "5 1 2" occurs once (followed by 3); "1 2" alone occurs later (followed by 9)
    tokens = [5, 1, 2, 3, 0, 1, 2, 9, 0, 5, 1, 2]
    assert NgramProposer(2, 3).propose(tokens, 1) == [3]
    assert NgramProposer(2, 2).propose(tokens, 1) == [9]


def test_at_most_k_tokens_and_no_more_than_the_context_holds():
    tokens = [4, 5, 6, 7, 8, 4, 5]
    assert NgramProposer(2, 3).propose(tokens, 3) == [6, 7, 8]
    assert NgramProposer(2, 3).propose(tokens, 10) == [6, 7, 8, 4, 5]
    assert NgramProposer(2, 3).propose(tokens, 0) == []


def test_no_match_proposes_nothing():
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramProposer(2, 4).propose([1, 1], 4) == []  # too short for a suffix and a match
    # ngram_min 1: a single repeated token matches
    assert NgramProposer(1, 2).propose([3, 9, 3], 2) == [9, 3]


def test_a_repeating_run_proposes_its_continuation():
    # the most recent match of "9 7 8 9" starts at 2: what follows it is the last period
    tokens = [7, 8, 9] * 3
    assert NgramProposer(2, 4).propose(tokens, 4) == [7, 8, 9]
