"""The decode engine: the same tokens as transformers' generate (every family, with a LoRA adapter,
in fp32), continuous batching that changes no request's output, sampling that a seed alone fixes,
and one clear error for a request it cannot take. The paged cache's own behaviour (prefix
caching, chunked prompts, preemption) is tests/test_engine_paged.py's."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.utils import counters

from families import FAMILIES, tiny_family_model
from helpers import HostReads
from onegpu.errors import ConfigError
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.paged_cache import cache_kwarg, kv_bytes_per_position
from onegpu.infer.requests import SamplingParams

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2"]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _ids(tok, prompts=PROMPTS):
    return [tok(p)["input_ids"] for p in prompts]


def _hf_greedy(model, ids, new, **kw):
    """transformers' greedy tokens; it stops at EOS as the engine does (its min_new_tokens would
    forbid EOS instead, which the engine's ignore_eos does not)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0, **kw
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate_for_every_family(family, tiny_tokenizer):
    model = tiny_family_model(family, tiny_tokenizer).eval()
    ids = _ids(tiny_tokenizer)
    # three prompts of different lengths in one batch: each slot at its own position
    params = SamplingParams(max_new_tokens=12)
    got = Engine(model, None, EngineConfig(max_slots=3, max_len=64)).generate(ids, params)
    for row, res in zip(ids, got, strict=True):
        assert res.token_ids == _hf_greedy(model, row, params.max_new_tokens), family


def test_greedy_equals_hf_generate_with_a_lora_adapter(tiny_tokenizer):
    peft = pytest.importorskip("peft")
    base = tiny_family_model("llama", tiny_tokenizer)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a trained adapter, not the identity PEFT starts from
            torch.nn.init.normal_(p, std=0.5)
    model.eval()
    ids = _ids(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=12)
    got = Engine(model, None, EngineConfig(max_slots=3, max_len=64)).generate(ids, params)
    with model.disable_adapter():
        plain = Engine(model, None, EngineConfig(max_slots=3, max_len=64)).generate(ids, params)
    for row, res in zip(ids, got, strict=True):
        assert res.token_ids == _hf_greedy(model, row, params.max_new_tokens)
    assert any(a.token_ids != b.token_ids for a, b in zip(got, plain, strict=True))


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


def test_a_request_joining_mid_flight_changes_no_output(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    alone = [Engine(llama, None, EngineConfig(max_slots=1)).generate([r], GREEDY)[0] for r in ids]
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=64, sync_every=4))
    first = engine.submit(ids[0], GREEDY)
    news = {first: []}
    for u in engine.step():  # the first request decodes alone for a while
        news[u.request_id] += u.token_ids
    later = [engine.submit(r, GREEDY) for r in ids[1:]]  # one joins now, one waits for a slot
    news.update({r: [] for r in later})
    while engine.has_work():
        for u in engine.step():
            news[u.request_id] += u.token_ids
    assert [news[r] for r in [first, *later]] == [a.token_ids for a in alone]


def test_the_first_token_goes_out_at_admission_then_sync_every_in_one_read_back(
    llama, tiny_tokenizer
):
    """A prompt's first token goes out with the step that computed the prompt (its time to first
    token is its prefill, not the prefill and sync_every decode steps); then sync_every decode
    steps of both rows run on the device; each step copies values to the host once."""
    engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=5))
    for row in _ids(tiny_tokenizer)[:2]:
        engine.submit(row, SamplingParams(max_new_tokens=20))
    with HostReads() as reads:
        first = engine.step()
    assert [len(u.token_ids) for u in first] == [1, 1] and all(u.first_token for u in first)
    assert len(reads.calls) == 1, reads.calls
    with HostReads() as reads:
        second = engine.step()
    assert [len(u.token_ids) for u in second] == [5, 5] and len(reads.calls) == 1, reads.calls


def test_flush_ms_runs_fewer_steps_between_read_backs_where_the_steps_are_slow(
    llama, tiny_tokenizer
):
    """flush_ms caps the decode steps between read-backs at what fits in it at the measured pace:
    a bound below any step's time sends each token as it comes once a read-back was timed, a
    bound of a second leaves sync_every; the tokens are the same either way."""
    from onegpu.errors import ConfigError

    ids = _ids(tiny_tokenizer)[:2]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)

    def per_read_back(flush_ms):
        engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=8, flush_ms=flush_ms))
        for row in ids:
            engine.submit(row, params)
        sizes, tokens = [], {}
        while engine.has_work():
            news = engine.step()
            sizes.append(max(len(u.token_ids) for u in news))
            for u in news:
                tokens.setdefault(u.request_id, []).extend(u.token_ids)
        return sizes, list(tokens.values())

    each, tokens = per_read_back(1e-6)
    assert each[:2] == [1, 8] and set(each[2:]) == {1}  # the first decode read-back is timed
    whole, same = per_read_back(1000.0)
    assert whole[:4] == [1, 8, 8, 8] and same == tokens
    with pytest.raises(ConfigError, match="flush_ms"):
        Engine(llama, None, EngineConfig(flush_ms=0))


def test_a_seed_fixes_a_sample_wherever_the_request_sits(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    sample = [
        SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=s)
        for s in (1, 2, 3)
    ]
    engine = Engine(llama, None, EngineConfig(max_slots=3, max_len=64))
    a = engine.generate(ids, sample)
    b = engine.generate(ids[::-1], sample[::-1])[::-1]  # other slots, other neighbours
    c = Engine(llama, None, EngineConfig(max_slots=1)).generate(ids[:1], sample[:1])
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].token_ids == c[0].token_ids
    other = engine.generate(ids[:1], [SamplingParams(max_new_tokens=16, temperature=1.0, seed=9)])
    assert other[0].token_ids != a[0].token_ids
    assert a[0].token_ids != engine.generate(ids[:1], GREEDY)[0].token_ids[:16]


def test_sampling_draws_from_the_softmax():
    from onegpu.infer.sampling import RowParams, next_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    rows = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    params = RowParams(
        rows(1.0, torch.float),
        rows(0, torch.long),
        rows(1.0, torch.float),
        rows(1.0, torch.float),
        torch.arange(n),  # n requests, n seeds
        rows(0, torch.long),
        torch.zeros(n, 4, dtype=torch.bool),
    )
    drawn = next_tokens(logits.expand(n, 4), params, sampling=True, penalty=False)
    freq = torch.bincount(drawn, minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.03)
    params.top_k[:] = 2  # only the two best tokens may be drawn
    drawn = next_tokens(logits.expand(n, 4), params, sampling=True, penalty=False)
    assert set(drawn.tolist()) == {0, 1}
    params.top_k[:], params.top_p[:] = 0, 0.5  # the best token alone holds over half the mass
    assert set(next_tokens(logits.expand(n, 4), params, True, False).tolist()) == {0}


def test_repetition_penalty_as_transformers_applies_it(llama, tiny_tokenizer):
    row = _ids(tiny_tokenizer)[0]
    params = SamplingParams(max_new_tokens=16, repetition_penalty=1.5)
    got = Engine(llama, None, EngineConfig(max_slots=1)).generate([row], params)[0]
    want = _hf_greedy(llama, row, 16, repetition_penalty=1.5)
    assert got.token_ids == want and want != _hf_greedy(llama, row, 16)


def test_eos_and_stop_strings_end_a_request(llama, tiny_tokenizer):
    row = _ids(tiny_tokenizer)[0]
    engine = Engine(llama, tiny_tokenizer, EngineConfig(max_slots=1))
    full = engine.generate([row], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    eos = full.token_ids[5]  # the sixth token ends a sequence now
    ended = Engine(llama, tiny_tokenizer, EngineConfig(max_slots=1, eos_ids=[eos])).generate(
        [row], SamplingParams(max_new_tokens=24)
    )[0]
    assert (
        ended.finish_reason == "stop"
        and ended.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    )
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = engine.generate([row], SamplingParams(max_new_tokens=24, stop=(stop,), ignore_eos=True))
    assert cut[0].finish_reason == "stop" and cut[0].text == text[: text.index(stop)]


def test_the_pool_is_sized_to_the_requests_not_the_context(llama):
    """By default the pool holds every row's worst case (max_slots x max_len, in whole blocks, and
    the reserved null block); num_blocks sizes it otherwise."""
    engine = Engine(llama, None, EngineConfig(max_slots=4, max_len=96))
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    per_position = kv_bytes_per_position(llama)
    assert engine.stats().kv_bytes == (4 * 96 // 16 + 1) * 16 * per_position
    small = Engine(llama, None, EngineConfig(max_slots=4, max_len=96, num_blocks=8))
    small.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    assert small.stats().kv_bytes == 8 * 16 * per_position
    with pytest.raises(ConfigError, match="hold less than one sequence of max_len 96"):
        Engine(llama, None, EngineConfig(max_slots=4, max_len=96, num_blocks=6))


def test_the_cache_is_sized_to_the_request_not_the_context(tiny_tokenizer):
    """``generate`` on the engine, with a model whose context is 4,096 positions: the pool its
    steps read holds the longest prompt + new tokens (in 64s) per row, in blocks of 16 and the
    null block — not the context."""
    from onegpu.infer import SamplingConfig, generate

    model = tiny_family_model("llama", tiny_tokenizer, max_position_embeddings=4096).eval()
    caches = []

    def spy(module, args, kwargs):
        view = kwargs.get(cache_kwarg(module))  # the forward's view of the engine's pool
        if view is not None and not caches:
            caches.append(view.pool)

    hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        for prompts, positions in ((PROMPTS[:2], 64), ([" ".join(["x = 1"] * 20)], 128)):
            caches.clear()
            longest = max(len(tiny_tokenizer(p)["input_ids"]) for p in prompts)
            assert longest + 12 <= positions < longest + 12 + 64
            generate(
                model, tiny_tokenizer, prompts, SamplingConfig(max_new_tokens=12, batch_size=2)
            )
            rows = len(prompts)
            pool = (rows * positions // 16 + 1) * 16
            assert [k.shape[1] for k in caches[0].keys] == [pool] * 2
            assert caches[0].bytes == pool * kv_bytes_per_position(model)
    finally:
        hook.remove()
    cfg = model.config  # K and V, fp32, every layer
    head = cfg.hidden_size // cfg.num_attention_heads
    assert (
        kv_bytes_per_position(model)
        == 2 * 4 * cfg.num_key_value_heads * head * cfg.num_hidden_layers
    )


def test_cancel_frees_the_slot_for_the_next_request(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    engine = Engine(llama, None, EngineConfig(max_slots=1, sync_every=2))
    a = engine.submit(ids[0], GREEDY)
    b = engine.submit(ids[1], GREEDY)
    engine.step()
    assert engine.stats().running == 1 and engine.stats().waiting == 1
    engine.cancel(a)
    news = engine.step()
    assert (news[0].request_id, news[0].finish_reason) == (a, "cancelled")
    assert engine.stats().running == 1 and news[1].request_id == b


def test_bad_requests_are_one_clear_error(llama):
    engine = Engine(llama, None, EngineConfig(max_slots=1, max_len=32))
    with pytest.raises(ConfigError, match="over the engine's limit of 32 tokens"):
        engine.submit(list(range(30)), SamplingParams(max_new_tokens=8))
    with pytest.raises(ConfigError, match="top_p has an invalid value"):
        engine.submit([1, 2], SamplingParams(top_p=0))
    with pytest.raises(ConfigError, match="adapter 'nope' is not loaded"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=4), adapter="nope")
    for bad in ([1, 10**6], [-1, 2]):
        with pytest.raises(ConfigError, match="outside the model's vocabulary"):
            engine.submit(bad, SamplingParams(max_new_tokens=4))
    assert not engine.has_work()  # nothing half-queued


def test_compiled_step_gives_the_eager_tokens(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    eager = Engine(llama, None, EngineConfig(max_slots=3, max_len=64)).generate(ids, GREEDY)
    counters.clear()
    # aot_eager traces the same graph inductor would compile, without its C++ build time
    config = EngineConfig(max_slots=3, max_len=64, compile="on", compile_backend="aot_eager")
    compiled = Engine(llama, None, config).generate(ids, GREEDY)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
    assert counters["stats"]["unique_graphs"] >= 1  # the step really went through torch.compile


@pytest.mark.slow  # an inductor compile of each MoE family's step: 26-31 CPU s from a cold cache
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_compiled_step_runs_moe_experts_without_host_reads(family, tiny_tokenizer):
    """A CUDA graph refuses a host read of the routing (the card found transformers' grouped_mm
    fallback calling tolist() in a captured step): the compiled decode step runs the experts as
    batched_mm, gives HF's greedy tokens, and leaves the model's own kernel in place."""
    model = tiny_family_model(family, tiny_tokenizer).eval()
    before = model.config._experts_implementation
    seen = []
    for m in model.modules():
        if getattr(m, "has_gate", None) is not None:
            m.register_forward_pre_hook(
                lambda mod, a: seen.append(mod.config._experts_implementation)
            )
    ids = _ids(tiny_tokenizer)
    config = EngineConfig(max_slots=3, max_len=64, compile="on", compile_backend="aot_eager")
    got = Engine(model, None, config).generate(ids, GREEDY)
    for row, res in zip(ids, got, strict=True):
        assert res.token_ids == _hf_greedy(model, row, GREEDY.max_new_tokens), family
    assert "batched_mm" in seen and model.config._experts_implementation == before


@pytest.mark.slow
def test_a_compiled_step_reads_the_weights_as_they_are_now(tiny_tokenizer):
    """The compiled CPU step takes the weights as inputs, not constants folded in at its compile:
    GRPO's sampler decodes with the policy as it is after each optimizer step."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids, full = _ids(tiny_tokenizer)[:1], SamplingParams(max_new_tokens=12, ignore_eos=True)
    compiled = Engine(model, None, EngineConfig(max_slots=1, max_len=64, compile="on"))
    eager = Engine(model, None, EngineConfig(max_slots=1, max_len=64, compile="off"))
    before = eager.generate(ids, full)[0].token_ids
    assert compiled.generate(ids, full)[0].token_ids == before
    with torch.no_grad():
        model.lm_head.weight.neg_()  # a training step, as far as the engines can tell
    after = eager.generate(ids, full)[0].token_ids
    assert after != before
    assert compiled.generate(ids, full)[0].token_ids == after


@pytest.mark.slow
def test_engines_over_different_models_keep_their_own_compiled_steps(tiny_tokenizer):
    """Two engines over different models, compiled and interleaved, each keep their own tokens
    (Dynamo would otherwise hand one the other's compiled entry); after a reset of Dynamo a
    warm engine compiles again."""
    ids, params = _ids(tiny_tokenizer), SamplingParams(max_new_tokens=10, ignore_eos=True)
    config = EngineConfig(max_slots=3, max_len=64, compile="on", compile_backend="aot_eager")
    models = [tiny_family_model(f, tiny_tokenizer).eval() for f in ("llama", "qwen2")]
    eager = [Engine(m, None, EngineConfig(max_slots=3, max_len=64)) for m in models]
    want = [[r.token_ids for r in e.generate(ids, params)] for e in eager]
    engines = [Engine(m, None, config) for m in models]
    for _ in range(2):
        for engine, tokens in zip(engines, want, strict=True):
            assert [r.token_ids for r in engine.generate(ids, params)] == tokens
    torch._dynamo.reset()
    counters.clear()
    assert [r.token_ids for r in engines[1].generate(ids, params)] == want[1]
    assert counters["stats"]["unique_graphs"] >= 1  # compiled again, not failed


def test_the_compiled_argmax_is_argmax_ties_included():
    """sampling.first_argmax, as a compiled step runs it: the first index of the maximum (a
    tie goes to the lower token id, as argmax), and a row of NaN stays inside the vocabulary."""
    from onegpu.infer.sampling import first_argmax

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    x[1, 7] = x[1, 250] = x[1].max() + 1  # a tie
    x[2] = 3.0  # every token ties
    compiled = torch.compile(first_argmax, backend="aot_eager")
    assert torch.equal(compiled(x), x.argmax(-1))
    assert compiled(x)[1] == 7 and compiled(x)[2] == 0
    x[4] = float("nan")
    assert 0 <= compiled(x)[4] < 300


@pytest.mark.slow
def test_a_fixed_shape_engine_compiles_one_step_for_every_length_and_row_count(tiny_tokenizer):
    """fixed_shape (GRPO's compiled sampler): requests of different lengths and budgets, rows
    finishing at different steps, then a smaller batch — every step is the one (all slots, whole
    cache) bucket, and the greedy tokens are the eager engine's."""
    ids = _ids(tiny_tokenizer)
    budgets = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 17, 9)]
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    eager = Engine(model, None, EngineConfig(max_slots=4, max_len=128))
    config = EngineConfig(4, 128, compile="on", compile_backend="aot_eager", fixed_shape=True)
    fixed = Engine(model, None, config)
    bucketed = Engine(model, None, EngineConfig(4, 128, compile="on", compile_backend="aot_eager"))
    for batch, params in ((ids, budgets), (ids[1:], budgets[:2])):
        want = [r.token_ids for r in eager.generate(batch, params)]
        assert [r.token_ids for r in fixed.generate(batch, params)] == want
        assert [r.token_ids for r in bucketed.generate(batch, params)] == want
    assert {(rows, kv_len) for rows, kv_len, _ in fixed.stats().compiled_shapes} == {(4, 128)}
    assert {(s.rows, s.kv_len) for s in fixed.stats().decode_shapes} == {(4, 128)}
    # without it: a step per (rows, length) bucket
    assert len(bucketed.stats().compiled_shapes) > 1


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_step_attends_over_the_positions_it_reaches_not_the_requests_final_length(
    llama, tiny_tokenizer, compiled
):
    """Each decode step covers the rows in use and the positions its steps reach, growing with the
    answer — eager in whole 64s, compiled in power-of-two buckets of that reach — not a bucket of
    the request's final length (a chat without max_tokens would attend over the whole cache at
    every step); the tokens stay transformers' across every growth."""
    row = _ids(tiny_tokenizer)[0]
    extra = dict(compile="on", compile_backend="aot_eager") if compiled else {}
    engine = Engine(llama, None, EngineConfig(max_slots=3, max_len=512, sync_every=8, **extra))
    got = engine.generate([row], SamplingParams(max_new_tokens=150))[0].token_ids
    assert got == _hf_greedy(llama, row, 150) and len(row) + len(got) > 128
    shapes = engine.stats().decode_shapes  # in the order first run
    # the final length's bucket would be 256 positions of 3 rows
    assert (shapes[0].rows, shapes[0].kv_len) == (1, 64)
    assert all(s.reach < s.kv_len for s in shapes)  # every write lands inside the view
    # the last token's input was written (the steps of a run past its end write nothing)
    assert max(s.reach for s in shapes) >= len(row) + len(got) - 2
    want = [64, 128, 256] if compiled else [64, 128, 192]
    assert sorted({s.kv_len for s in shapes}) == want


def test_a_step_ends_where_a_budget_ends_and_when_interrupted(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=8))
    short = engine.submit(ids[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    long_ = engine.submit(ids[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    news = [(u.request_id, len(u.token_ids), u.finished) for u in engine.step()]
    assert news == [(short, 1, False), (long_, 1, False)]  # the first tokens, at admission
    # two decode steps end the short request: the step stops there, not after sync_every, so
    # its answer goes out and its row frees at once
    news = [(u.request_id, len(u.token_ids), u.finished) for u in engine.step()]
    assert news == [(short, 2, True), (long_, 2, False)] and engine.free_slots() == 1
    arrived = threading.Event()
    arrived.set()  # say, a request arrived, and a row is free for it
    news = engine.step(arrived=arrived)
    assert [len(u.token_ids) for u in news] == [1]
    total = 3 + 1
    while engine.has_work():
        total += sum(len(u.token_ids) for u in engine.step())
    assert total == 20  # nothing lost or repeated by the short steps
