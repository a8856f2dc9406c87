"""`onegpu serve` on the paged engine: requests arriving while others decode — long prompts among
them, computed in pieces over several steps, streamed and not — get the answers they get alone
and that the engine gives with whole prompts; a repeated prompt is found in the prefix cache and a
KV budget far too small preempts, both counted in /metrics; and the engine loop ends a decode run
for a request that arrives while a row is free."""

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
    args += ["--max_slots", "3", "--sync_every", "4", "--token_budget", "32"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


def _answer(client, job) -> str:
    prompt, tokens, stream = job
    kw = dict(model="tiny", prompt=prompt, max_tokens=tokens, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))


def _engine_answers(model_dir, jobs) -> list[str]:
    """The engine's answers in this process, whole prompts a step (a budget past the longest)."""
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams

    loaded = load(InferConfig(model=str(model_dir)))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(token_budget=1024))
    ids = [loaded.tokenizer(p)["input_ids"] for p, _, _ in jobs]
    params = [SamplingParams(max_new_tokens=n) for _, n, _ in jobs]
    return [r.text for r in engine.generate(ids, params)]


def test_requests_arriving_while_others_decode_get_their_answers_alone(server, tiny_model_dir):
    client = openai_client(server)
    jobs = [(p, 8 + 6 * (i % 4), i % 2 == 0) for i, p in enumerate(PROMPTS * 2)]
    alone = [_answer(client, job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:  # more requests than rows
        together = list(pool.map(lambda job: _answer(client, job), jobs))
    assert together == alone
    assert _engine_answers(tiny_model_dir, jobs) == alone
    # every prompt was sent three times: its full blocks were found again
    assert server.metric("onegpu_prefix_cache_hits_total") > 0
    assert "prefix caching: on" in server.log.read_text(errors="replace")


def test_a_kv_budget_far_too_small_preempts_and_every_answer_is_the_one_alone(
    tiny_model_dir, tmp_path
):
    # the tiny Llama's position takes 512 bytes: a budget of 17 blocks of 16 holds one sequence
    # of max_len 256 and the null block
    budget = 17 * 16 * 512 / 2**30
    args = ["--model", str(tiny_model_dir), "--served_name", "tiny", "--max_len", "256"]
    args += ["--max_slots", "4", "--kv_memory", str(budget), "--prefix_caching", "false"]
    srv = Server(args, tmp_path / "server.log")
    try:
        client = openai_client(srv)
        jobs = [(p, 60, False) for p in PROMPTS]
        alone = [_answer(client, job) for job in jobs]
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: _answer(client, job), jobs))
        assert together == alone
        assert srv.metric("onegpu_num_preemptions_total") > 0
        assert srv.metric("onegpu_prefix_cache_hits_total") == 0
    finally:
        srv.stop()


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


def test_a_command_waiting_with_a_row_free_ends_the_engines_decode_run(tiny_model_dir):
    """The engine loop running for real, runs of 64 decode steps: a request that arrives while
    another decodes and a row is free starts at the next step. The running request's run ends
    short (under 64 tokens) before the newcomer's first token; its tokens are unchanged."""
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler, Ticket

    loaded = load(InferConfig(model=str(tiny_model_dir)))
    config = EngineConfig(max_slots=2, max_len=256, sync_every=64)
    engine = Engine(loaded.model, None, config)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    alone = engine.generate([[1, 2, 3]], long)[0].token_ids
    scheduler = Scheduler(engine, queue_size=2, metrics=Metrics())
    scheduler.start()
    log: list = []
    try:
        scheduler.submit(Ticket([([1, 2, 3], long)], None, _Delivered("a", log)))
        _wait(log, lambda log: len(log) > 1)  # a's first token, then its first run: it is in
        # its second run of 64 now
        time.sleep(0.02)  # well inside that run of 64 steps, not between two
        scheduler.submit(Ticket([([4, 5], long)], None, _Delivered("b", log)))
        _wait(log, lambda log: sum(u.finished for _, u in log) == 2)
    finally:
        scheduler.stop()
    b_first = next(i for i, (name, _) in enumerate(log) if name == "b")
    before = [len(u.token_ids) for name, u in log[1:b_first] if name == "a"]
    assert any(n < 64 for n in before), [(name, len(u.token_ids)) for name, u in log]
    assert [t for name, u in log if name == "a" for t in u.token_ids] == alone
