"""The logprobs of the engine's tokens: each token's and its step's likeliest, equal to the
log-softmax of the model's own logits (a full forward per token, fp32) — before any penalty or
temperature, as vLLM reports them — for the first token (sampled after the prompt) and every
decode step, over several steps between read-backs, eager and compiled; one per token of each
Update, cut to the request's own k, and nothing for a request that did not ask."""

from __future__ import annotations

import pytest
import torch

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2"]
NEW = 10


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


def run(engine: Engine, prompts, settings) -> dict:
    """Each request's updates, in order, by the prompt's index."""
    rids = [engine.submit(p, s) for p, s in zip(prompts, settings, strict=True)]
    got = {r: [] for r in rids}
    while engine.has_work():
        for u in engine.step():
            got[u.request_id].append(u)
    return {i: got[r] for i, r in enumerate(rids)}


def reference(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's log-softmax before each of ``tokens``: [len(tokens), vocab], one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)


def check(model, prompt, updates, k):
    tokens = [t for u in updates for t in u.token_ids]
    lps = [lp for u in updates for lp in u.logprobs]
    assert all(len(u.logprobs) == len(u.token_ids) for u in updates)
    assert updates[0].first_token and len(updates[0].logprobs) == 1  # the first token has its own
    ref = reference(model, prompt, tokens)
    for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert lp.token_id == token
        assert abs(lp.logprob - ref[j, token].item()) < 1e-4
        values, order = torch.topk(ref[j], k)
        assert [i for i, _ in lp.top] == order.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=0)
    return tokens


@pytest.mark.parametrize("sync_every", [1, 4])
def test_logprobs_are_the_models_log_softmax_at_each_token(llama, ids, sync_every):
    engine = Engine(llama, None, EngineConfig(max_slots=3, max_len=64, sync_every=sync_every))
    settings = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=5),
        SamplingParams(max_new_tokens=NEW, ignore_eos=True),  # asks for none
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=20),
    ]
    got = run(engine, ids, settings)
    for i, k in ((0, 5), (2, 20)):
        tokens = check(llama, ids[i], got[i], k)
        # greedy: the chosen token is the likeliest, its logprob the first of the top
        assert all(lp.top[0] == (lp.token_id, lp.logprob) for u in got[i] for lp in u.logprobs)
        assert len(tokens) == NEW
    assert all(u.logprobs is None for u in got[1])
    plain = Engine(llama, None, EngineConfig(max_slots=1)).generate([ids[1]], settings[1])[0]
    assert [t for u in got[1] for t in u.token_ids] == plain.token_ids  # and its tokens as alone


def test_logprobs_are_of_the_raw_logits_not_the_penalised_or_tempered_ones(llama, ids):
    """A sampled, penalised request: its logprobs are the model's own distribution at each
    token, whatever token was drawn (k = 0: the chosen token's logprob alone)."""
    settings = [
        SamplingParams(
            max_new_tokens=NEW,
            ignore_eos=True,
            temperature=1.5,
            top_k=50,
            seed=4,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            logprobs=k,
        )
        for k in (0, 3)
    ]
    got = run(
        Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=3)), ids[:2], settings
    )
    check(llama, ids[0], got[0], 0)
    check(llama, ids[1], got[1], 3)
    assert all(lp.top == () for u in got[0] for lp in u.logprobs)


def test_a_compiled_step_gives_the_eager_logprobs(llama, ids):
    settings = [
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=4),
        SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=1, logprobs=2),
    ]
    eager = run(
        Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4)), ids[:2], settings
    )
    # aot_eager traces the graph inductor would compile, without its C++ build time
    config = EngineConfig(
        max_slots=2, max_len=64, sync_every=4, compile="on", compile_backend="aot_eager"
    )
    engine = Engine(llama, None, config)
    compiled = run(engine, ids[:2], settings)
    assert any(needs.logprobs for _, _, needs in engine.stats().compiled_shapes)
    for i in range(2):
        want = [lp for u in eager[i] for lp in u.logprobs]
        got = [lp for u in compiled[i] for lp in u.logprobs]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        for a, b in zip(got, want, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    check(llama, ids[0], compiled[0], 4)


def test_a_batch_without_logprobs_reads_back_as_before(llama, ids):
    """The needs of a batch that asks for none leave the step as it was: no logprobs computed."""
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4))
    got = run(engine, ids[:2], [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * 2)
    assert all(u.logprobs is None for us in got.values() for u in us)
    assert torch.all(engine.rows.chosen == 0)  # never written


def test_a_step_with_logprobs_still_copies_to_the_host_once(llama, ids):
    """The logprobs ride in the tokens' one copy: the step that computes the prompts (their first
    tokens) and the sync_every decode steps after it each read the device once."""
    from helpers import HostReads

    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4))
    for prompt, k in zip(ids[:2], (2, None), strict=True):
        engine.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=k))
    for expect in (1, 4):
        with HostReads() as reads:
            news = engine.step()
        assert len(reads.calls) == 1, reads.calls
        assert [len(u.logprobs or []) for u in news] == [expect, 0]


def test_a_prompts_logprobs_are_the_models_over_the_whole_prompt_cached_or_not(llama, ids):
    """prompt_logprobs (completions' echo): one per prompt token, the first None, each the
    log-softmax of the logits before it; computed in pieces (chunk 4) and again for a second
    request whose prompt is in the prefix cache (which it does not take)."""
    prompt = ids[1] * 3  # long enough for several pieces and a full block
    asked = SamplingParams(max_new_tokens=2, prompt_logprobs=3)
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=96, chunk=4, block_size=4))
    plain = run(engine, [prompt], [SamplingParams(max_new_tokens=2)])[0]
    assert plain[0].prompt_logprobs is None  # not asked for
    for _ in range(2):  # the second finds the prompt cached and computes it all the same
        first = run(engine, [prompt], [asked])[0][0]
        got = first.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        want = reference(llama, prompt[:1], prompt[1:])
        assert [t.token_id for t in got[1:]] == prompt[1:]
        assert [t.logprob for t in got[1:]] == pytest.approx(
            want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4
        )
        top = want.topk(3, -1)
        assert [[i for i, _ in t.top] for t in got[1:]] == top.indices.tolist()
    assert engine.stats().prefix_hits == 0  # the prompt was cached, and not taken
    run(engine, [prompt], [SamplingParams(max_new_tokens=2)])
    assert engine.stats().prefix_hits > 0  # as a plain request takes it
