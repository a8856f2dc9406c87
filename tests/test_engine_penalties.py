"""OpenAI's presence and frequency penalties in the decode engine: greedy tokens equal a reference
loop over the model's own logits (a full forward per token, the formula applied by hand), eager,
compiled and over several decode steps between read-backs; a row that does not penalise gets its
tokens bit for bit as if no row did; counts cover the generated tokens only, and are rebuilt when
a preempted request is computed again."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nclass Foo:"]
NEW = 16


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


def reference(model, prompt: list[int], new: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's penalties written out: the whole sequence through the model
    at each step, ``logit - count * frequency - (count > 0) * presence`` over the counts of the
    tokens generated so far (the prompt's are not counted)."""
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            counts = Counter(out)
            for token, c in counts.items():
                logits[token] -= c * frequency + presence
            nxt = int(logits.argmax())
            out.append(nxt)
            tokens.append(nxt)
    return out


def params(presence=0.0, frequency=0.0, **kw) -> SamplingParams:
    kw = {"max_new_tokens": NEW, "ignore_eos": True, **kw}
    return SamplingParams(presence_penalty=presence, frequency_penalty=frequency, **kw)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_greedy_penalised_tokens_equal_the_reference_loop(llama, ids, sync_every):
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=sync_every))
    settings = [(0.0, 2.0), (1.5, -0.5)]
    got = engine.generate(ids, [params(p, f) for p, f in settings])
    for prompt, (p, f), res in zip(ids, settings, got, strict=True):
        assert res.token_ids == reference(llama, prompt, NEW, p, f)
    plain = reference(llama, ids[0], NEW, 0.0, 0.0)
    assert got[0].token_ids != plain  # the penalty changed the answer


def test_penalties_of_0_change_no_token_and_a_strong_one_does(llama, ids):
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64))
    before = [r.token_ids for r in engine.generate(ids, params())]
    zero = [r.token_ids for r in engine.generate(ids, params(presence=0.0, frequency=0.0))]
    assert zero == before
    strong = engine.generate(ids, params(frequency=2.0))
    for tokens, res in zip(before, strong, strict=True):
        assert res.token_ids != tokens
        assert max(Counter(res.token_ids).values()) < max(Counter(tokens).values())


@pytest.mark.parametrize("sample", [False, True])
def test_a_row_that_does_not_penalise_gets_its_solo_tokens_in_a_penalised_batch(llama, ids, sample):
    """The batch's step applies the penalties to every row; a row with both at 0 subtracts 0 and
    draws exactly what it draws alone (sampled too: the same logits, bit for bit)."""
    free = params(temperature=1.0 if sample else 0.0, seed=7)
    alone = Engine(llama, None, EngineConfig(max_slots=1)).generate([ids[1]], free)[0]
    mixed = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4)).generate(
        ids, [params(presence=2.0, frequency=2.0), free]
    )
    assert mixed[1].token_ids == alone.token_ids
    assert mixed[0].token_ids == reference(llama, ids[0], NEW, 2.0, 2.0)


def test_a_compiled_step_applies_the_penalties_as_the_eager_one(llama, ids):
    settings = [params(frequency=1.0), params(presence=0.5, temperature=1.0, seed=3)]
    eager = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4))
    # aot_eager traces the graph inductor would compile, without its C++ build time
    config = EngineConfig(
        max_slots=2, max_len=64, sync_every=4, compile="on", compile_backend="aot_eager"
    )
    compiled = Engine(llama, None, config)
    want = [r.token_ids for r in eager.generate(ids, settings)]
    assert [r.token_ids for r in compiled.generate(ids, settings)] == want
    assert want[0] == reference(llama, ids[0], NEW, 0.0, 1.0)
    assert any(needs.penalties for _, _, needs in compiled.stats().compiled_shapes)


@pytest.mark.slow  # an inductor compile of the penalised step with logprobs: ~20 CPU s
def test_an_inductor_compiled_step_applies_the_penalties_and_gives_the_logprobs(llama, ids):
    """The step as a GPU server compiles it (inductor): penalties, counts and the log-softmax and
    top-k of the logprobs inside one compiled graph."""
    settings = params(presence=1.0, frequency=1.0, logprobs=3)
    config = EngineConfig(max_slots=2, max_len=64, sync_every=4, compile="on")
    compiled = Engine(llama, None, config)
    eager = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4))
    got, want = ({}, {})
    for engine, out in ((compiled, got), (eager, want)):
        rids = [engine.submit(p, settings) for p in ids]
        while engine.has_work():
            for u in engine.step():
                out.setdefault(rids.index(u.request_id), []).extend(u.logprobs)
    assert any(
        needs.logprobs and needs.penalties for _, _, needs in compiled.stats().compiled_shapes
    )
    for i, prompt in enumerate(ids):
        assert [lp.token_id for lp in got[i]] == reference(llama, prompt, NEW, 1.0, 1.0)
        for a, b in zip(got[i], want[i], strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_prompts_tokens_are_not_counted_and_preemption_rebuilds_the_counts(
    llama, tiny_tokenizer
):
    """A pool far too small preempts; a preempted request is computed again from its prompt and
    output, its counts rebuilt from its output alone: every answer is still the reference's."""
    texts = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2", "The quick brown fox"]
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts]
    settings = [params(presence=0.5 * i, frequency=1.0, max_new_tokens=24) for i in range(4)]
    tight = Engine(llama, None, EngineConfig(max_slots=4, max_len=64, num_blocks=6, sync_every=4))
    got = tight.generate(prompts, settings)
    assert tight.stats().preemptions > 0
    for prompt, s, res in zip(prompts, settings, got, strict=True):
        want = reference(llama, prompt, 24, s.presence_penalty, s.frequency_penalty)
        assert res.token_ids == want


def test_a_rows_counts_start_at_0_and_are_rebuilt_from_its_output_alone():
    from onegpu.infer.rows import Rows
    from onegpu.infer.scheduler import Plan, Sequence

    def started(row, settings, prompt, output=()):
        seq = Sequence(row, prompt, settings, None, None, tokens=[*prompt, *output], row=row)
        return Plan(started=(seq,))

    rows = Rows(2, 1, 10, [], 1, "cpu")
    rows.counts.fill_(3)  # what the row's last request left
    rows.apply(started(0, params(frequency=1.0), [1, 2, 5]))  # admitted: its prompt only
    assert rows.counts[0].sum() == 0 and rows.counts[1].sum() == 30
    rows.apply(started(1, params(presence=1.0), [5, 5, 4], [7, 5]))  # recomputed
    assert rows.counts[1].tolist() == [0, 0, 0, 0, 0, 1, 0, 1, 0, 0]
