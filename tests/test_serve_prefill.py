"""`onegpu serve` with its prefills on a second thread (a CPU server with a spare core): requests
arriving while others decode — long prompts among them, streamed and not — get the answers they
get alone and that the engine gives without the thread; and the engine loop ends a decode chunk
for a request that arrives while a slot is free."""

from __future__ import annotations

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


def test_a_command_waiting_with_a_slot_free_ends_the_engines_chunk(tiny_model_dir):
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams
    from onegpu.serve.metrics import Metrics
    from onegpu.serve.scheduler import Scheduler

    loaded = load(InferConfig(model=str(tiny_model_dir)))
    engine = Engine(loaded.model, None, EngineConfig(max_slots=1, prefill_thread="off"))
    scheduler = Scheduler(engine, queue_size=2, metrics=Metrics())
    assert not scheduler._arrived()  # nothing waits
    scheduler._inbox.put(("cancel", None))
    assert scheduler._arrived()  # a command waits, the slot is free
    engine.submit([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()
    assert not scheduler._arrived()  # the one slot is taken: nothing would start
