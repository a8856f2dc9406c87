"""The engine's on-device draw: one counter-based uniform per row, the inverse CDF of the kept
tokens (sampling.uniform, sampling.draw)."""

from __future__ import annotations

import torch

from onegpu.infer.sampling import draw, uniform, unit


def test_the_uniform_is_never_0_or_1_even_at_the_extreme_hashes():
    """The largest and smallest 32-bit hashes stay inside (0, 1) in float32 (24 bits and a half
    would round the largest to 1.0, and a Gumbel noise of it to infinity)."""
    x = torch.tensor([0, 1, 2**32 - 1, 2**32 - 2, 2**31], dtype=torch.long)
    u = unit(x)
    assert u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all()), u
    seeds = torch.arange(20000)
    u = uniform(seeds, torch.full_like(seeds, 3))
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005


def test_draw_is_the_inverse_cdf_across_blocks_and_ragged_ends():
    """200 tokens (3 blocks of 64 and a ragged 8): for targets just below and at each running
    sum, the index is the first token whose running sum passes the target."""
    torch.manual_seed(0)
    w = torch.rand(1, 200) + 0.01
    cum = w[0].cumsum(0)
    total = cum[-1]
    for i in (0, 1, 63, 64, 65, 127, 128, 191, 192, 199):
        lo = (cum[i - 1] if i else torch.tensor(0.0)) / total
        hi = cum[i] / total
        u = torch.tensor([(lo + hi).item() / 2])
        assert draw(w, u, torch.tensor([-1])).item() == i


def test_draw_never_returns_a_token_of_weight_0():
    """Weights with zeros everywhere but a few tokens (a top-k row), and u from every corner of
    (0, 1): only weighted tokens come back, at their probabilities; a ragged vocabulary never
    yields an index past its end."""
    vocab = 1000
    w = torch.zeros(1, vocab)
    w[0, [0, 63, 64, 999]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    u = torch.cat([unit(torch.tensor([0, 2**32 - 1])), (torch.arange(9999) + 0.5) / 9999])
    got = draw(w.expand(len(u), vocab), u, torch.full((len(u),), -1))
    assert set(got.tolist()) <= {0, 63, 64, 999}
    freq = torch.bincount(got, minlength=vocab)[[0, 63, 64, 999]].float() / len(u)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=2e-3, rtol=0)


def test_compiled_draw_equals_eager():
    torch.manual_seed(0)
    w = torch.rand(16, 4096).pow(8)
    u = uniform(torch.arange(16), torch.full((16,), 5))
    fallback = torch.zeros(16, dtype=torch.long)
    compiled = torch.compile(draw, dynamic=False)
    assert torch.equal(compiled(w, u, fallback), draw(w, u, fallback))
