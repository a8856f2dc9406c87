"""A CPU engine's prefills on a second thread: the running requests decode while a prompt is
prefilled, the tokens are those of prefills run inline, the slot being prefilled is not written by
the decode steps meanwhile, a request cancelled during its prefill frees its slot, and the thread
is used only where it is safe."""

from __future__ import annotations

import threading

import pytest
import torch

from families import tiny_family_model
from onegpu.errors import ConfigError
from onegpu.infer import decode_step
from onegpu.infer import prefill_thread as pt
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    # 4 query heads over 2 key/value heads: the decode steps switch the model's attention to the
    # engine's GQA function while a prefill runs beside them
    return tiny_family_model("llama", tiny_tokenizer).eval()


class Gate:
    """Holds the prefill of one prompt after its forward has written the cache (the thread's
    result not handed back yet) until opened; records the thread of every prefill."""

    def __init__(self, monkeypatch, prompt: list[int]):
        self.prompt, self.open, self.threads = prompt, threading.Event(), []
        self.reached = threading.Event()
        real = pt.prefill

        def gated(engine, seq, cache=None, routed=None):
            out = real(engine, seq, cache, routed)
            self.threads.append(threading.current_thread().name)
            if seq.prompt == self.prompt:
                self.reached.set()
                assert self.open.wait(30), "the test never opened the gate"
            return out

        def inline(engine, seq, cache=None, routed=None):
            self.threads.append(threading.current_thread().name)
            return real(engine, seq, cache, routed)

        monkeypatch.setattr(pt, "prefill", gated)
        monkeypatch.setattr(decode_step, "prefill", inline)  # the engine thread's own


def _alone(model, prompt, params):
    return Engine(model, None, EngineConfig(max_slots=1, prefill_thread="off")).generate(
        [prompt], params
    )[0]


def _step(engine, news):
    for u in engine.step():
        news.setdefault(u.request_id, []).extend(u.token_ids)


def _drain(engine, news):
    while engine.has_work():
        _step(engine, news)


def test_the_running_requests_decode_while_a_prompt_prefills(llama, tiny_tokenizer, monkeypatch):
    first = tiny_tokenizer("def add(a, b):")["input_ids"]
    later = tiny_tokenizer("import os\nclass Foo:\n    x = [1, 2, 3]")["input_ids"]
    gate = Gate(monkeypatch, later)
    engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=4, prefill_thread="on"))
    a = engine.submit(first, LONG)
    news = {}
    _step(engine, news)
    b = engine.submit(later, LONG)
    _step(engine, news)  # admits b: its prefill goes to the thread, where the gate holds it
    assert gate.reached.wait(30)
    before = len(news[a])
    for _ in range(3):  # a goes on decoding while b's prefill is held
        _step(engine, news)
    assert len(news[a]) > before and b not in news
    assert engine.stats().running == 2  # b holds its slot meanwhile
    gate.open.set()
    _drain(engine, news)
    assert gate.threads and all(t.startswith("onegpu-prefill") for t in gate.threads)
    assert news[a] == _alone(llama, first, LONG).token_ids
    assert news[b] == _alone(llama, later, LONG).token_ids


def test_the_decode_steps_leave_the_slot_being_prefilled_alone(llama, tiny_tokenizer, monkeypatch):
    """The freed slot's last position (inside the new, longer prompt) would be overwritten by the
    decode steps that run after the prefill wrote the cache and before the request joins."""
    short, long_ = tiny_tokenizer("x = 1")["input_ids"], tiny_tokenizer(" ".join(["word"] * 24))
    long_ = long_["input_ids"]
    other = tiny_tokenizer("def add(a, b):")["input_ids"]
    gate = Gate(monkeypatch, long_)
    engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=2, prefill_thread="on"))
    quick = engine.submit(short, SamplingParams(max_new_tokens=3, ignore_eos=True))
    slow = engine.submit(other, SamplingParams(max_new_tokens=60, ignore_eos=True))
    news = {}
    while quick not in news or len(news[quick]) < 3:  # slot 0 frees at position len(short) + 2
        _step(engine, news)
    assert len(short) + 2 < len(long_)
    late = engine.submit(long_, LONG)
    _step(engine, news)
    assert gate.reached.wait(30)
    for _ in range(3):  # decode steps of 2 rows (slot 1 runs) while slot 0's prefill is held
        _step(engine, news)
    gate.open.set()
    _drain(engine, news)
    assert news[late] == _alone(llama, long_, LONG).token_ids
    assert news[slow] == _alone(llama, other, SamplingParams(60, ignore_eos=True)).token_ids


def test_a_request_cancelled_while_it_prefills_frees_its_slot(llama, tiny_tokenizer, monkeypatch):
    first = tiny_tokenizer("def add(a, b):")["input_ids"]
    later = tiny_tokenizer("import os")["input_ids"]
    gate = Gate(monkeypatch, later)
    engine = Engine(llama, None, EngineConfig(max_slots=2, sync_every=4, prefill_thread="on"))
    engine.submit(first, LONG)
    engine.step()
    b = engine.submit(later, LONG)
    engine.step()
    assert gate.reached.wait(30)
    engine.cancel(b)
    assert engine.free_slots() == 0  # the thread may still write into b's slot
    gate.open.set()
    news = {}
    cancelled = []
    while engine.has_work():
        step = engine.step()
        for u in step:
            news.setdefault(u.request_id, []).extend(u.token_ids)
        gone = [u.request_id for u in step if u.finish_reason == "cancelled"]
        if gone:  # b's slot is free, a still runs
            assert engine.free_slots() == 1 and engine.stats().running == 1
        cancelled += gone
    assert cancelled == [b] and b not in {k for k, v in news.items() if v}
    assert engine.generate([later], SamplingParams(max_new_tokens=5, ignore_eos=True))


def test_many_requests_get_the_tokens_of_inline_prefills(tiny_tokenizer):
    """Staggered requests of many lengths, a prompt repeated (its KV copied from the first), n
    sampled with seeds: the same tokens with the thread as without."""
    model = tiny_family_model("qwen2", tiny_tokenizer).eval()
    texts = ["def f(x):", "import os\nclass Foo:", "x = [1, 2", "def f(x):", "y" * 40, "a = 3"]
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts * 2]
    params = [
        SamplingParams(max_new_tokens=5 + 3 * i, temperature=1.0 if i % 3 else 0.0, seed=i)
        for i in range(len(prompts))
    ]
    runs = []
    for mode in ("off", "on"):
        engine = Engine(model, None, EngineConfig(max_slots=4, sync_every=3, prefill_thread=mode))
        ids, news = [], {}
        for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
            ids.append(engine.submit(p, s))
            if i % 3 == 2:  # a few arrive while the others decode
                _step(engine, news)
        _drain(engine, news)
        runs.append([news[i] for i in ids])
        assert (engine.prefills is not None) == (mode == "on")
    assert runs[0] == runs[1]


def test_the_thread_runs_only_where_it_is_safe_and_a_core_is_spare(
    llama, tiny_tokenizer, monkeypatch
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(pt, "_cores", lambda: 3)
    assert Engine(llama, None, EngineConfig(max_slots=1)).prefills is None  # auto: no spare core
    monkeypatch.setattr(pt, "_cores", lambda: 4)
    auto = Engine(llama, None, EngineConfig(max_slots=1)).prefills
    assert auto is not None and auto.threads == 2
    compiled = dict(max_slots=1, compile="on", compile_backend="eager")
    assert Engine(llama, None, EngineConfig(**compiled)).prefills is None
    with pytest.raises(ConfigError, match="decode steps are compiled"):
        Engine(llama, None, EngineConfig(**compiled, prefill_thread="on"))
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    dynamic = tiny_family_model("llama", tiny_tokenizer, rope_parameters=rope).eval()
    assert Engine(dynamic, None, EngineConfig(max_slots=1)).prefills is None
    with pytest.raises(ConfigError, match="dynamic"):
        Engine(dynamic, None, EngineConfig(prefill_thread="on"))


def test_with_adapters_routed_prefills_run_inline(tiny_tokenizer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_family_model("llama", tiny_tokenizer),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        adapter_name="one",
    ).eval()
    gate = Gate(monkeypatch, [-1])  # holds nothing; records where each prefill ran
    gate.open.set()
    engine = Engine(model, None, EngineConfig(max_slots=2, prefill_thread="on"))
    ids = [tiny_tokenizer(t)["input_ids"] for t in ("def f(x):", "import os")]
    out = engine.generate(ids, SamplingParams(max_new_tokens=4), adapters=["one", None])
    assert len(out) == 2 and gate.threads == ["MainThread"] * 2  # both inline, none on the thread


def test_in_a_burst_the_engines_thread_prefills_too(llama, tiny_tokenizer, monkeypatch):
    texts = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2", "The quick brown fox"]
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts]
    gate = Gate(monkeypatch, prompts[1])  # the thread's prefill of the second prompt is held
    engine = Engine(llama, None, EngineConfig(max_slots=4, sync_every=4, prefill_thread="on"))
    ids = [engine.submit(prompts[0], LONG)]
    news = {}
    _step(engine, news)  # one running
    ids.append(engine.submit(prompts[1], LONG))
    _step(engine, news)
    assert gate.reached.wait(30)  # the thread is busy with it
    ids += [engine.submit(p, LONG) for p in prompts[2:]]  # two arrive at once
    del gate.threads[:]
    _step(engine, news)
    # two wait to start, one runs: the engine's thread prefilled the older of the two itself
    assert gate.threads == ["MainThread"]
    assert ids[2] in news and ids[1] not in news and ids[3] not in news
    gate.open.set()
    _drain(engine, news)
    assert [news[i] for i in ids] == [_alone(llama, p, LONG).token_ids for p in prompts]
