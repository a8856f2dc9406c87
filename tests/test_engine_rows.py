"""The running sequences keep the lowest decode rows: when one ends below others, the sequence of
the highest row moves into its row, so the decode steps compute no empty row between live ones;
its settings, what it has seen and its KV's eager copy go with it, and no answer changes."""

from __future__ import annotations

import pytest

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

PROMPTS = [[11 + 5 * i + j for j in range(6 + 3 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


def _run(model, params, **kw):
    """Each request's tokens, and the rows each engine step's decode steps computed (its stats:
    rows over steps since the last step)."""
    engine = Engine(model, None, EngineConfig(max_slots=4, max_len=96, sync_every=4, **kw))
    ids = [engine.submit(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    tokens, rows, before = {i: [] for i in ids}, [], engine.stats()
    while engine.has_work():
        for u in engine.step():
            tokens[u.request_id] += u.token_ids
        now = engine.stats()
        steps = now.decode_steps - before.decode_steps
        if steps:
            rows.append((now.decode_rows - before.decode_rows) / steps)
        before = now
    return [tokens[i] for i in ids], rows


def test_a_sequence_that_ends_gives_its_row_to_the_highest_running_one(llama):
    # rows 0 and 1 end early; the sequences of rows 2 and 3 go on alone
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 5, 40, 40)]
    compact, rows = _run(llama, params)
    assert rows[-5:] == [2] * 5  # steps long after both ended: two sequences decode
    kept, rows = _run(llama, params, compact_rows=False)
    assert rows[-5:] == [4] * 5  # without compaction the empty rows 0 and 1 are computed
    assert compact == kept
    alone = [Engine(llama, None, EngineConfig(max_slots=1, max_len=96)) for _ in PROMPTS]
    assert compact == [
        e.generate([p], s)[0].token_ids for e, p, s in zip(alone, PROMPTS, params, strict=True)
    ]


def test_a_moved_row_keeps_its_sampling_its_penalties_and_its_logprobs(llama):
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    # the moved sequences sample with a seed, penalties, top-k/top-p and logprobs
    moved = [
        SamplingParams(
            max_new_tokens=30,
            ignore_eos=True,
            temperature=0.9,
            top_k=50,
            top_p=0.9,
            seed=seed,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            logprobs=3,
        )
        for seed in (5, 9)
    ]
    params = [short, short, *moved]
    compact, kept = _each(llama, params), _each(llama, params, compact_rows=False)
    assert [tokens for tokens, _ in compact] == [tokens for tokens, _ in kept]
    # the same logprobs and alternatives; the values as a step of fewer rows computes them
    for (_, ours), (_, theirs) in zip(compact, kept, strict=True):
        assert [(t.token_id, [i for i, _ in t.top]) for t in ours] == [
            (t.token_id, [i for i, _ in t.top]) for t in theirs
        ]
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5)
    tokens, logprobs = compact[2]
    assert len(set(tokens)) > 5 and len(logprobs) == 30  # sampled, each token's logprobs given


def _each(model, params, **kw):
    """Each request's tokens and logprobs, from an engine's updates."""
    engine = Engine(model, None, EngineConfig(max_slots=4, max_len=96, sync_every=4, **kw))
    ids = [engine.submit(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    got = {i: ([], []) for i in ids}
    while engine.has_work():
        for u in engine.step():
            got[u.request_id][0].extend(u.token_ids)
            got[u.request_id][1].extend(u.logprobs or [])
    return [got[i] for i in ids]
