"""The engine's warm-up: every decode shape compiled before the first request, so that serving
compiles nothing (Dynamo's own count agrees), with the tokens of an engine that compiled as it
went; a kind of request the warm-up left out compiles once, and is counted."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from families import tiny_family_model
from onegpu.infer.engine import WARM_KINDS, Engine, EngineConfig
from onegpu.infer.requests import SamplingParams
from onegpu.infer.sampling import Needs

PROMPTS = ["the cat sat", "a b c d e f g h i j k l m n o p", "hello there", "x"]
# aot_eager traces the graph inductor would compile, without its C++ build time
COMPILED = dict(max_slots=2, max_len=128, compile="on", compile_backend="aot_eager")


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


def _requests(tok):
    """Greedy and sampled requests of several lengths: short and long KV."""
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=7)
        for n, t in zip((70, 8, 30, 3), (0.0, 1.0, 0.0, 0.7), strict=True)
    ]
    return ids, params


def _tokens(engine, ids, params):
    return [r.token_ids for r in engine.generate(ids, params)]


def test_a_warm_engine_compiles_nothing_while_serving(llama, tiny_tokenizer):
    ids, params = _requests(tiny_tokenizer)
    # one row (two KV-length buckets): the fast tier's time; a server's several rows are the
    # serve warm-up test's (test_serve_warmup.py)
    expected = _tokens(Engine(llama, None, EngineConfig(max_slots=1, max_len=128)), ids, params)
    engine = Engine(llama, None, EngineConfig(**{**COMPILED, "max_slots": 1}))
    buckets = engine.buckets()
    assert buckets == [(1, 64), (1, 128)]
    assert engine.warmup() == len(buckets) * len(WARM_KINDS)
    assert engine.stats().compiled_shapes == {(r, k, n) for r, k in buckets for n in WARM_KINDS}
    counters.clear()
    assert _tokens(engine, ids, params) == expected  # the warm-up left no state behind
    assert _tokens(engine, ids[:1], params[:1]) == expected[:1]
    assert engine.stats().compiles == 0
    assert counters["stats"]["unique_graphs"] == 0  # Dynamo's own count: nothing traced


def test_a_kind_the_warm_up_left_out_compiles_once_and_is_counted(llama, tiny_tokenizer):
    ids, _ = _requests(tiny_tokenizer)
    engine = Engine(llama, None, EngineConfig(**{**COMPILED, "max_len": 64}))
    assert engine.warmup(kinds=(Needs(),)) == 2
    logprobs = SamplingParams(max_new_tokens=4, logprobs=2, ignore_eos=True)
    engine.generate(ids[:1], logprobs)
    stats = engine.stats()
    assert stats.compiles == 1 and stats.compile_s > 0
    engine.generate(ids[2:3], logprobs)  # the same bucket: warm now
    assert engine.stats().compiles == 1


def test_an_eager_engine_has_nothing_to_warm_and_a_busy_one_refuses(llama, tiny_tokenizer):
    assert Engine(llama, None, EngineConfig(max_slots=2, max_len=64)).warmup() == 0
    ids, params = _requests(tiny_tokenizer)
    expected = _tokens(Engine(llama, None, EngineConfig(max_slots=2, max_len=128)), ids, params)
    engine = Engine(llama, None, EngineConfig(**COMPILED))
    rid = engine.submit(ids[0], params[0])
    first = engine.step()  # its prompt computed: its row decodes now, its state not the warm-up's
    with pytest.raises(RuntimeError, match="before any row decodes"):
        engine.warmup()
    tokens = [t for u in first for t in u.token_ids]
    while engine.has_work():  # the refused warm-up left the running request as it was
        tokens += [t for u in engine.step() if u.request_id == rid for t in u.token_ids]
    assert tokens == expected[0]
