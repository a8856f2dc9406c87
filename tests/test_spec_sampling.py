"""The speculative acceptance rule (sampling.speculative_accept) keeps the target's distribution:
with a point-mass proposal x (prompt lookup) over a small vocabulary and many seeds, the first
token follows the target's filtered softmax, x is accepted with probability p(x), and the token
after an accepted x follows the target's distribution there — temperature 0.7 and 1.0, with and
without top-p (chi-square tests). Greedy, the rule keeps the longest agreeing prefix and the
target's token after it.

Seen to fail against a broken rule (one token accepted too many: ``+ 1`` on the count, capped at
k): the acceptance-rate and second-token tests failed, and greedy's expected counts did not hold;
the rule was then restored."""

from __future__ import annotations

import pytest
import torch

from onegpu.infer.sampling import RowParams, next_tokens, speculative_accept

chisquare = pytest.importorskip("scipy.stats").chisquare

VOCAB, DRAWS = 8, 20_000


def _params(n: int, temperature: float, top_p: float, step: torch.Tensor) -> RowParams:
    ones = torch.ones(n)
    return RowParams(
        temperature * ones,
        torch.zeros(n, dtype=torch.long),
        top_p * ones,
        ones,
        torch.arange(n, dtype=torch.long) // 2,  # one seed a draw, two positions each
        step,
        torch.zeros(n, VOCAB, dtype=torch.bool),
    )


def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The filtered softmax plain decoding draws from (transformers' top-p)."""
    probs = (logits / temperature).softmax(-1)
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(-1) - ordered) < top_p
    kept = torch.zeros_like(probs).scatter(0, order, ordered * keep)
    return kept / kept.sum()


def _check(observed: torch.Tensor, expected: torch.Tensor) -> None:
    assert observed[expected == 0].sum() == 0  # a filtered-out token is never drawn
    live = expected > 0
    assert live.sum() > 1  # a test of a distribution, not of one certain token
    obs, exp = observed[live].double(), expected[live].double()
    assert chisquare(obs, exp / exp.sum() * obs.sum()).pvalue > 1e-3


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.8)])
def test_the_speculative_sampler_follows_the_targets_distribution(temperature, top_p):
    torch.manual_seed(0)
    first, second = torch.randn(VOCAB) / 2, torch.randn(VOCAB) / 2  # position 1's logits follow x
    logits = torch.stack([first, second]).repeat(DRAWS, 1)
    step = torch.tensor([0, 1]).repeat(DRAWS)
    params = _params(2 * DRAWS, temperature, top_p, step)
    targets = next_tokens(logits, params, sampling=True, penalty=False).view(DRAWS, 2)
    p0, p1 = _target(first, temperature, top_p), _target(second, temperature, top_p)
    x = int(first.argsort(descending=True)[1])  # the proposal: the second likeliest token
    accepted = speculative_accept(targets, torch.full((DRAWS, 1), x))
    # the first token is the target's draw, whatever was proposed
    _check(torch.bincount(targets[:, 0], minlength=VOCAB), p0)
    # x is accepted with probability p(x): a second token comes exactly then
    two = accepted == 1
    assert (two == (targets[:, 0] == x)).all()
    counts = torch.tensor([int(two.sum()), int((~two).sum())])
    _check(counts, torch.tensor([float(p0[x]), 1 - float(p0[x])]))
    # the token after an accepted x follows the target's distribution there
    _check(torch.bincount(targets[two, 1], minlength=VOCAB), p1)


def test_greedy_keeps_the_agreeing_prefix_and_the_targets_next_token():
    targets = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 3]])
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    # all three and the bonus; one and the target's 9; none and its 1; all three and its 3
    assert speculative_accept(targets, proposals).tolist() == [3, 1, 0, 3]
    # a later agreement after a mismatch does not count
    assert speculative_accept(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 9]])).tolist() == [1]
