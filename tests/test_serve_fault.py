"""An engine-wide fault (a step that raises, not one request's error): every request in flight gets
OpenAI's error object (a stream its error event and [DONE]), admission closes, /health answers 503
with the error, and the server stops and exits 1, for a supervisor to restart it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import httpx

from serve_fakes import CRASH, LiveApp, make_service
from serve_support import SRC, TESTS, free_port
from test_serve_api import chat, error_of, post, sse

LONG = "word " * 300


def crash_or_long(prompt: str, params) -> str:
    return CRASH if "crashme" in prompt else LONG


def _stream_in_flight(live, engine, got: dict) -> threading.Thread:
    """A long stream, running in the engine when this returns."""
    reader = threading.Thread(
        target=lambda: got.update(
            stream=post(live, "/v1/chat/completions", chat(stream=True, max_tokens=400))
        )
    )
    reader.start()
    deadline = time.monotonic() + 10
    while not engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.has_work()
    return reader


def test_a_fault_answers_every_request_then_health_fails_and_the_server_is_told_to_stop(
    tiny_tokenizer,
):
    service, engine = make_service(tiny_tokenizer, crash_or_long, step_s=0.01)
    told = []
    service.scheduler.on_failure = lambda: told.append(threading.current_thread().name)
    live = LiveApp(service)
    try:
        assert httpx.get(f"{live.url}/health", timeout=10).json()["status"] == "ok"
        got = {}
        reader = _stream_in_flight(live, engine, got)
        crashed = post(live, "/v1/chat/completions", chat("crashme"))
        reader.join(timeout=30)
        err = error_of(crashed, 500)
        assert err["code"] == "engine_failed" and "injected engine fault" in err["message"]
        events = sse(got["stream"])  # the neighbour: its tokens so far, then the error
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed"
        assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-2])
        health = httpx.get(f"{live.url}/health", timeout=10)
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "failed" and "injected engine fault" in body["error"]
        assert body["in_flight"] == 0 and not body["accepting"]
        later = error_of(post(live, "/v1/chat/completions", chat("hi")), 500)
        assert later["code"] == "engine_failed"  # refused at once, not queued for a dead loop
        assert told == ["engine-loop"]  # told once, after every request had its answer
    finally:
        live.stop()


CHILD = """
import sys
from transformers import AutoTokenizer
from serve_fakes import CRASH, make_service
from onegpu.serve.app import build_app
from onegpu.serve.server import run_server

tok = AutoTokenizer.from_pretrained(sys.argv[1])
script = lambda prompt, params: CRASH if "crashme" in prompt else "hello"
service, _ = make_service(tok, script)
sys.exit(run_server(build_app(service), service.scheduler, "127.0.0.1", int(sys.argv[2]), 5.0))
"""


def test_the_server_exits_1_after_an_engine_fault(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]), OMP_NUM_THREADS="1")
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CHILD), str(tiny_model_dir), str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.post(f"{url}/v1/chat/completions", json=chat("hi"), timeout=30).is_success
        crashed = httpx.post(f"{url}/v1/chat/completions", json=chat("crashme"), timeout=30)
        assert crashed.status_code == 500 and crashed.json()["error"]["code"] == "engine_failed"
        assert proc.wait(timeout=30) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "the engine failed" in text and "exiting 1" in text
