"""The engine over its paged KV cache: a prefix cached by one request is computed once (a shared
system prompt, a chat's next turn) and changes no answer; a long prompt is computed in pieces
while the others keep decoding; a pool far too small for the load preempts and recomputes, and
every request still gets the answer it gets alone; at the same KV memory more sequences run at
once than a cache of worst-case slots holds; text is decoded one token at a time."""

from __future__ import annotations

import random

import pytest

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.output import Output
from onegpu.infer.requests import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval()


def _computed(before, now) -> tuple[int, int]:
    """The forwards of prompt pieces between two of an engine's stats, and the positions they
    computed."""
    return (
        now.prefill_forwards - before.prefill_forwards,
        now.prefill_tokens - before.prefill_tokens,
    )


def _alone(model, prompt, params, **kw):
    engine = Engine(model, None, EngineConfig(max_slots=1, max_len=160, **kw))
    return engine.generate([prompt], params)[0].token_ids


def test_a_shared_system_prompt_is_computed_once_and_changes_no_answer(llama):
    system = [(7 * i) % 300 + 10 for i in range(48)]  # three full blocks
    prompts = [system + [11 + i, 12, 13 + i] for i in range(3)]
    cached = Engine(llama, None, EngineConfig(max_slots=4, max_len=160))
    answers, computed = [], []
    for p in prompts:  # one after another
        before = cached.stats()
        answers.append(cached.generate([p], GREEDY)[0].token_ids)
        computed.append(_computed(before, cached.stats()))
    # the later ones compute only what follows the system prompt
    assert computed == [(1, 51), (1, 3), (1, 3)]
    stats = cached.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (3 * 51, 2 * 48)
    plain = Engine(llama, None, EngineConfig(max_slots=4, max_len=160, prefix_caching=False))
    assert [plain.generate([p], GREEDY)[0].token_ids for p in prompts] == answers
    assert plain.stats().prefix_hits == 0


def test_requests_arriving_together_with_one_system_prompt_compute_it_once(llama):
    """Six requests with one 64-token system prompt, all at once: the first computes it in
    pieces; the others wait while its next block is being computed (rather than computing it a
    second time) and then compute only their own last tokens."""
    system = [(11 * i) % 300 + 10 for i in range(64)]
    prompts = [system + [100 + i, 101, 102] for i in range(6)]
    config = EngineConfig(max_slots=8, max_len=160, token_budget=64, chunk=32)
    engine = Engine(llama, None, config)
    got = engine.generate(prompts, GREEDY)
    assert engine.stats().prefill_tokens == 67 + 5 * 3
    assert [r.token_ids for r in got] == [_alone(llama, p, GREEDY) for p in prompts]


def test_a_chats_next_turn_computes_only_the_new_turn(llama):
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=160))
    turn, turns, computed = [(5 * i) % 200 + 20 for i in range(30)], [], []
    for _ in range(3):  # each turn resends the history: prompt, answer, a new message
        before = engine.stats()
        answer = engine.generate([turn], SamplingParams(max_new_tokens=12))[0].token_ids
        computed.append(_computed(before, engine.stats()))
        turns.append((turn, answer))
        turn = turn + answer + [31, 32, 33, 34, 35]
    # the answer's own blocks were hashed as it was decoded: the next turn finds them too, and
    # computes its new message and what is left of the last block it did not fill
    assert computed[0] == (1, 30) and all(f == 1 and n <= 5 + 16 for f, n in computed[1:])
    for prompt, answer in turns:
        assert answer == _alone(llama, prompt, SamplingParams(max_new_tokens=12))


def test_a_long_prompt_is_computed_in_pieces_while_the_others_decode(llama):
    config = EngineConfig(max_slots=3, max_len=160, token_budget=32, sync_every=4)
    engine = Engine(llama, None, config)
    short = engine.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    long_prompt = [(3 * i) % 250 + 9 for i in range(100)]
    late = engine.submit(long_prompt, GREEDY)
    news: dict = {}
    steps, computed = 0, []
    while late not in news:  # the steps that compute the long prompt
        before = engine.stats()
        for u in engine.step():
            news.setdefault(u.request_id, []).append(len(u.token_ids))
        computed.append(_computed(before, engine.stats()))
        steps += 1
    # pieces end at multiples of the chunk (the budget), one forward a step
    assert computed == [(1, 32), (1, 32), (1, 32), (1, 4)]
    assert steps == 4 and news[short] == [1, 1, 1, 1]  # a token each step meanwhile
    while engine.has_work():
        engine.step()
    assert _alone(llama, long_prompt, GREEDY, token_budget=32) == _alone(llama, long_prompt, GREEDY)


def test_a_row_whose_prompt_is_being_computed_stays_out_of_the_decode_steps(llama):
    """Row 0 held a long sequence; it takes a new prompt, computed in pieces while row 1 decodes
    over fewer positions than the old sequence reached: the decode steps neither read nor write
    row 0 meanwhile (its old position lies outside their view)."""
    config = EngineConfig(max_slots=2, max_len=160, token_budget=16, sync_every=4)
    engine = Engine(llama, None, config)
    first = engine.submit(list(range(30, 130)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    short = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
    news: dict = {}
    while first not in news or len(news[first]) < 8:
        for u in engine.step():
            news.setdefault(u.request_id, []).extend(u.token_ids)
    prompt = list(range(40, 90))
    later = engine.submit(prompt, GREEDY)  # row 0 again
    while engine.has_work():
        for u in engine.step():
            news.setdefault(u.request_id, []).extend(u.token_ids)
    assert news[later] == _alone(llama, prompt, GREEDY)
    assert news[short] == _alone(llama, [5, 6, 7], SamplingParams(40, ignore_eos=True))


@pytest.mark.parametrize("sample", [False, True])
def test_a_pool_far_too_small_preempts_and_every_answer_is_the_one_alone(
    llama, tiny_tokenizer, sample
):
    texts = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2", "The quick brown fox"] * 2
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts]
    params = [
        SamplingParams(max_new_tokens=24 + 3 * i, temperature=1.0 if sample else 0.0, seed=i)
        for i in range(len(prompts))
    ]
    # room for one sequence of max_len (4 blocks) and one block more, for 4 rows
    tight = Engine(llama, None, EngineConfig(max_slots=4, max_len=64, num_blocks=6, sync_every=4))
    got = tight.generate(prompts, params)
    alone = [_alone(llama, p, s) for p, s in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in got] == alone
    assert tight.stats().preemptions > 0 and tight.stats().running == 0


def test_the_same_kv_memory_runs_more_sequences_than_worst_case_slots(llama):
    """A budget of 2 sequences of max_len 128: a slot cache runs 2 at once; the pool runs each
    short request in the blocks its length needs."""
    engine = Engine(llama, None, EngineConfig(max_slots=8, max_len=128, num_blocks=2 * 8 + 1))
    for i in range(8):
        engine.submit([10 + i, 11, 12, 13], SamplingParams(max_new_tokens=20, ignore_eos=True))
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.stats().running)
    assert peak == 8


def test_a_prefix_cached_under_one_adapter_is_not_found_under_another(tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_family_model("llama", tiny_tokenizer),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        adapter_name="one",
    ).eval()
    engine = Engine(model, None, EngineConfig(max_slots=2, max_len=96))
    prompt = list(range(20, 60))
    with_adapter = engine.generate([prompt], GREEDY, adapters=["one"])[0].token_ids
    base = engine.generate([prompt], GREEDY, adapters=["__base__"])[0].token_ids
    assert engine.stats().prefix_hits == 0 and with_adapter != base
    assert engine.generate([prompt], GREEDY, adapters=["one"])[0].token_ids == with_adapter
    assert engine.stats().prefix_hits == 32
    engine.reset_prefix_cache()  # the weights changed, as after a training step
    engine.generate([prompt], GREEDY, adapters=["one"])
    assert engine.stats().prefix_hits == 32


def test_an_eager_window_gathers_a_sequences_blocks_once_not_at_every_step(llama):
    """Eager decode steps read a copy of their rows' KV gathered when a sequence starts decoding
    and kept up to date from run to run (the policy row eager_window); without it every step
    gathers its rows' blocks. The tokens are the same either way."""
    prompts = [list(range(20, 40)), list(range(50, 75))]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = {}
    for off in ([], ["eager_window"]):
        config = EngineConfig(max_slots=2, max_len=96, sync_every=4, policy_off=off)
        engine = Engine(llama, None, config)
        runs[bool(off)] = [r.token_ids for r in engine.generate(prompts, params)]
        stats = engine.stats()
        assert ("eager_window" in stats.policy_rows) == (not off)
        runs[f"{bool(off)} gathers"] = stats.kv_gathers
        runs[f"{bool(off)} steps"] = stats.decode_steps
    assert runs[False] == runs[True]
    assert runs["False gathers"] == 2  # both rows' blocks, once
    assert runs["True steps"] == 39 and runs["True gathers"] == 2 * 39  # at every decode step


def test_the_eager_windows_copy_grows_no_larger_than_the_engines_rows_and_max_len(llama):
    """The window's copy grows by doubling, up to the engine's rows and its max_len in whole
    blocks: a run that needs 3 rows of 70 positions grows it to the 3 rows and 80 positions the
    engine can ever ask for (doubling without that bound made it 6 rows of 128)."""
    config = EngineConfig(max_slots=3, max_len=80, block_size=16, sync_every=4)
    engine = Engine(llama, None, config)
    prompts = [list(range(5, 60)), list(range(7, 20)), list(range(9, 30))]
    want = [_alone(llama, p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts]
    got = engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [r.token_ids for r in got] == want
    shapes = {tuple(c.shape) for c in engine.runner.window.keys + engine.runner.window.values}
    heads = llama.config.num_key_value_heads
    dim = llama.config.hidden_size // llama.config.num_attention_heads
    assert shapes == {(3, heads, 80, dim)}


def test_blocks_are_zeroed_at_their_first_use_not_at_start(llama):
    """The pool is allocated empty (a budget of gigabytes is not written at start): a block is
    zeroed when first handed out, so what a masked position holds is finite — memory left as NaN
    past the blocks used so far changes no answer."""
    engine = Engine(llama, None, EngineConfig(max_slots=4, max_len=96, num_blocks=40))
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    want = [_alone(llama, p, GREEDY) for p in prompts]
    engine.generate(prompts[:1], GREEDY)
    used = engine.cache.clean * engine.cache.block_size
    assert 1 < engine.cache.clean < 40
    for pool in engine.cache.keys + engine.cache.values:
        pool[:, used:] = float("nan")
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == want


def test_text_is_decoded_one_token_at_a_time_and_equals_the_whole_decode(tiny_tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(len(tiny_tokenizer)) for _ in range(200)]
    ids += tiny_tokenizer("héllo wörld ✓ 你好")["input_ids"]
    calls = []
    real = tiny_tokenizer.decode
    tiny_tokenizer.decode = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        out = Output(tiny_tokenizer, ())
        shown = ""
        for i in range(0, len(ids), 7):  # a read-back of 7 tokens at a time
            out.add(ids[i : i + 7])
            shown += out.take(final=False)
        shown += out.take(final=True)
    finally:
        del tiny_tokenizer.decode
    assert shown == real(ids, skip_special_tokens=True)
    assert all(len(a[0]) < 8 for a in calls)  # never the whole answer again (only a held tail)


def test_a_sentencepiece_answer_goes_on_where_tokenizers_stream_refuses_its_bytes(tmp_path):
    """Llama 2's and Mistral's kind of tokenizer (SentencePiece, byte fallback, Metaspace): on
    these random byte tokens tokenizers' DecodeStream raises ("Invalid prefix encountered"), which
    failed the request. The request goes on, and the real text after them reads as decoded alone
    (the random bytes' own text is not stable under any decode: the byte decoder regroups them)."""
    from tokenizers.decoders import DecodeStream

    from helpers import CORPUS
    from llama_support import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer(tmp_path / "spm", "llama", CORPUS)
    rng = random.Random(0)
    noise = [rng.randrange(3, len(tok)) for _ in range(40)]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in noise:
            stream.step(tok.backend_tokenizer, i)
    words = "def add(a, b):\n    return a + b  # héllo wörld ✓"
    ids = noise + tok(" " + words, add_special_tokens=False)["input_ids"]
    out = Output(tok, ())
    shown = ""
    for i in range(0, len(ids), 3):
        out.add(ids[i : i + 3])
        shown += out.take(final=False)
    shown += out.take(final=True)
    assert shown.endswith(" " + words)


@pytest.mark.parametrize("rows, whole", [(1, 64), (6, 512), (64, 4096)])
def test_the_recompile_allowance_covers_every_step_a_compiled_engine_can_ask_for(rows, whole):
    """Every (rows, kv_len) a compiled engine's decode runs over (Shapes.of, for every row count
    and reach) with every kind of sampling needs (each Needs field on or off) fits in
    Shapes.count(), the recompile limit the engine sets: past it dynamo would run a bucket
    eagerly."""
    import itertools
    from dataclasses import fields

    from onegpu.infer.engine_config import Shapes
    from onegpu.infer.sampling import Needs

    shapes = Shapes(rows, whole, 16, fixed=False, compiled=True)
    kinds = {Needs(*on) for on in itertools.product([False, True], repeat=len(fields(Needs)))}
    steps = {shapes.of(n, reach) for n in range(1, rows + 1) for reach in range(1, whole + 1)}
    assert len(steps) * len(kinds) <= shapes.count()
    assert Shapes(rows, whole, 16, fixed=True, compiled=True).count() >= len(kinds)


def test_a_prompt_one_token_past_a_chunk_computes_its_last_token_and_answers(llama):
    """A piece that ends one token short of the prompt's end is not its last: the last token is
    computed in the next piece and its logits choose the first answer token (a row that took
    that piece for the last one never began to decode, and its request never ended)."""
    prompt = [(5 * i) % 300 + 10 for i in range(33)]  # 32 + 1 with chunk 16
    want = _alone(llama, prompt, GREEDY)
    engine = Engine(llama, None, EngineConfig(max_slots=2, max_len=160, chunk=16))
    rid = engine.submit(prompt, GREEDY)
    tokens, done = [], False
    for _ in range(40):  # bounded: the bug left the request running forever
        for u in engine.step():
            tokens += u.token_ids if u.request_id == rid else []
            done = done or (u.request_id == rid and u.finished)
        if done:
            break
    assert done and tokens == want
