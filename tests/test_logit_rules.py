"""The per-request logit rules against their definitions, row by row: OpenAI's presence and
frequency penalties, the chosen tokens' logprobs and top alternatives, and a grammar's bitmask
(rows without a rule come back exactly as they were)."""

from __future__ import annotations

import math

import torch

from onegpu.infer.logit_rules import (
    apply_penalties,
    apply_token_bitmask,
    bitmask_words,
    count_tokens,
    token_logprobs,
    unpack_bitmask,
)


def test_penalties_follow_openais_formula_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    counts = torch.zeros(3, 10, dtype=torch.int32)
    count_tokens(counts, torch.tensor([4, 4, 1]), torch.tensor([True, True, True]))
    count_tokens(counts, torch.tensor([4, 2, 1]), torch.tensor([True, True, False]))  # row 2 done
    assert counts[0, 4] == 2 and counts[1, 4] == 1 and counts[1, 2] == 1 and counts[2, 1] == 1
    presence, frequency = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([0.25, 0.0, 0.0])
    out = apply_penalties(logits, counts, presence, frequency)
    for r in range(3):
        for j in range(10):
            c = int(counts[r, j])
            want = logits[r, j] - c * frequency[r] - (1.0 if c > 0 else 0.0) * presence[r]
            assert math.isclose(out[r, j].item(), want.item(), rel_tol=1e-6, abs_tol=1e-6)
    assert torch.equal(out[2], logits[2])  # penalties 0: untouched
    assert out.dtype == logits.dtype


def test_penalties_keep_half_precision_logits_in_their_dtype():
    logits = torch.randn(2, 8).bfloat16()
    counts = torch.ones(2, 8)
    out = apply_penalties(logits, counts, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    assert out.dtype == torch.bfloat16 and torch.equal(out[1], logits[1])


def test_logprobs_of_the_chosen_tokens_and_the_top_k():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    tokens = torch.tensor([3, 7, 0, 49])
    chosen, top_ids, top_lp = token_logprobs(logits, tokens, k=5)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, ref[torch.arange(4), tokens])
    assert torch.equal(top_ids, ref.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(top_lp, ref.gather(-1, top_ids))
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()  # most likely first
    _, none_ids, none_lp = token_logprobs(logits, tokens, k=0)
    assert none_ids.shape == (4, 0) and none_lp.shape == (4, 0)


def test_the_bitmask_masks_exactly_the_disallowed_tokens_of_constrained_rows():
    vocab = 70  # 3 words, the last one partly used
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [0, 31, 32, 63, 64, 69]] = True
    allowed[1] = True  # an unconstrained row
    bitmask = torch.zeros(2, bitmask_words(vocab), dtype=torch.int32)
    for r in range(2):
        for t in allowed[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    logits = torch.randn(2, vocab)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out[0].isfinite(), allowed[0])
    assert torch.equal(out[0][allowed[0]], logits[0][allowed[0]])
    all_ones = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask(logits[1:], all_ones), logits[1:])


def test_a_padded_embedding_masks_the_tokens_past_the_tokenizer():
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)  # a 32-token tokenizer, all allowed
    out = apply_token_bitmask(torch.zeros(1, 40), bitmask)
    assert out[0, :32].isfinite().all() and out[0, 32:].isinf().all()


def test_the_mask_of_the_constrained_rows_alone_leaves_the_others_untouched():
    torch.manual_seed(2)
    logits = torch.randn(4, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1  # row 2 may only write token 32
    out = apply_token_bitmask(logits, bitmask, rows=torch.tensor([2]))
    assert out[2].isfinite().nonzero().flatten().tolist() == [32]
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])
    full = torch.full((4, 2), -1, dtype=torch.int32)
    full[2] = bitmask[0]
    assert torch.equal(apply_token_bitmask(logits, full), out)
