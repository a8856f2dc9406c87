"""`onegpu serve` with its prefills on a second thread (a CPU server with a spare core): requests
arriving while others decode — long prompts among them, streamed and not — get the answers they
get alone and that the engine gives without the thread; and the engine loop ends a decode chunk
for a request that arrives while a slot is free."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_support import Server, openai_client

PROMPTS = [
    "def add(a, b):",
    " ".join(["def add(a, b): return a + b"] * 12),
    "class Point:",
    " ".join(["import os"] * 30),
    "The quick brown",
    "x = [1, 2",
]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--served_name", "tiny", "--max_len", "256"]
    args += ["--max_slots", "3", "--sync_every", "4", "--prefill_thread", "on"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


def _answer(client, job) -> str:
    prompt, tokens, stream = job
    kw = dict(model="tiny", prompt=prompt, max_tokens=tokens, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))


def test_requests_arriving_while_others_decode_get_their_answers_alone(server, tiny_model_dir):
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams

    client = openai_client(server)
    jobs = [(p, 8 + 6 * (i % 4), i % 2 == 0) for i, p in enumerate(PROMPTS * 2)]
    alone = [_answer(client, job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:  # more requests than slots
        together = list(pool.map(lambda job: _answer(client, job), jobs))
    assert together == alone
    loaded = load(InferConfig(model=str(tiny_model_dir)))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(prefill_thread="off"))
    ids = [loaded.tokenizer(p)["input_ids"] for p, _, _ in jobs]
    params = [SamplingParams(max_new_tokens=n) for _, n, _ in jobs]
    assert [r.text for r in engine.generate(ids, params)] == alone
    said = server.log.read_text(errors="replace")
    assert "prefills: on a second thread" in said and "Traceback" not in said


class _Delivered:
    """Stands in for a request's event loop: records each item the engine loop hands over, in
    the order the engine loop hands them, across requests."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def call_soon_threadsafe(self, put, item):
        self.log.append((self.name, item[1]))


def _wait(log, done, timeout=60.0):
    end = time.monotonic() + timeout
    while not done(log):
        assert time.monotonic() < end, log
        time.sleep(0.005)


def test_a_command_waiting_with_a_slot_free_ends_the_engines_chunk(tiny_model_dir):
    """The engine loop running for real, chunks of 64 decode steps: a request that arrives while
    another decodes and a slot is free starts at the next step. The running request's chunk ends
    short (under 64 tokens) before the newcomer's first token; its tokens are unchanged."""
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler, Ticket

    loaded = load(InferConfig(model=str(tiny_model_dir)))
    config = EngineConfig(max_slots=2, max_len=256, sync_every=64, prefill_thread="off")
    engine = Engine(loaded.model, None, config)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    alone = engine.generate([[1, 2, 3]], long)[0].token_ids
    scheduler = Scheduler(engine, queue_size=2, metrics=Metrics())
    scheduler.start()
    log: list = []
    try:
        scheduler.submit(Ticket([([1, 2, 3], long)], None, _Delivered("a", log)))
        _wait(log, lambda log: log)  # a's first chunk is out: it decodes its second now
        time.sleep(0.02)  # well inside that chunk of 64 steps, not between two chunks
        scheduler.submit(Ticket([([4, 5], long)], None, _Delivered("b", log)))
        _wait(log, lambda log: sum(u.finished for _, u in log) == 2)
    finally:
        scheduler.stop()
    b_first = next(i for i, (name, _) in enumerate(log) if name == "b")
    before = [len(u.token_ids) for name, u in log[1:b_first] if name == "a"]
    assert any(n < 64 for n in before), [(name, len(u.token_ids)) for name, u in log]
    assert [t for name, u in log if name == "a" for t in u.token_ids] == alone
