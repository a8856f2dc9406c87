"""Nothing lost, nobody let in: bad bodies and values out of range are 400s naming the field (an
unknown field is ignored and named in a header, test_serve_api.py); an unknown model is a 404; a
prompt over the context a 400 naming the limit; a wrong or missing key a 401; a full queue a 503
with Retry-After; a caller that leaves frees its slot; SIGTERM finishes what is in flight and exits
0, and a stream the grace period cuts ends with an error event and [DONE]. The server answers
normally after each of these."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from serve_support import Server, openai_client

KEY = "s3cret"
SLOTS, QUEUE, MAX_LEN = 2, 2, 256


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY, "--served_name", "tiny"]
    args += ["--max_len", str(MAX_LEN), "--max_slots", str(SLOTS), "--queue_size", str(QUEUE)]
    args += ["--sync_every", "2"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def post(server, path: str, body, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else None
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        json=None if content is not None else body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def still_serves(client) -> None:
    reply = client.completions.create(model="tiny", prompt="def", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_malformed_json_is_a_400(server, client):
    body = error(post(server, "/v1/completions", b'{"model": "tiny", "prompt": '), 400)
    assert body["code"] == "invalid_json" and "not valid JSON" in body["message"]
    body = error(post(server, "/v1/chat/completions", b"[1, 2]"), 400)
    assert "JSON object" in body["message"]
    still_serves(client)


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"temperature": 2.5}, "temperature"),
        ("/v1/completions", {"top_p": 0}, "top_p"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"stop": ["a", ""]}, "stop"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"seed": 2**63}, "seed"),
        ("/v1/completions", {"max_tokens": 4.5}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2}
    body.update(
        {"prompt": "def"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body.update(extra)
    err = error(post(server, path, body), 400)
    assert err["param"] == param and param in err["message"]


def test_a_missing_field_is_named(server):
    err = error(post(server, "/v1/completions", {"model": "tiny"}), 400)
    assert err["param"] == "prompt" and "required" in err["message"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="nope", prompt="def", max_tokens=2)
    assert raised.value.body["param"] == "model" and "tiny" in raised.value.body["message"]
    still_serves(client)


def test_a_prompt_over_the_context_is_a_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt="def", max_tokens=MAX_LEN)
    body = raised.value.body
    assert body["param"] == "max_tokens" and body["code"] == "context_length_exceeded"
    assert f"context of {MAX_LEN} tokens" in body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=[5] * MAX_LEN, max_tokens=1)
    assert raised.value.body["param"] == "prompt"
    still_serves(client)


def test_the_api_key_is_required(server, client):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert error(response, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # open to probes
    still_serves(client)


def _long_stream(client, n: int):
    """A streamed chat request that runs long enough to be interrupted (EOS ignored: a random
    model may end any answer early): its first chunk (the assistant's role) arrives once the
    server has accepted it."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=MAX_LEN - 16,
        n=n,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    return stream


def _wait_idle(server, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = server.health()
        if health["in_flight"] == 0 and health["running"] == 0:
            return health
        time.sleep(0.1)
    raise AssertionError(f"still busy after {timeout_s} s: {server.health()}")


def test_a_full_queue_answers_503_with_retry_after(server, client):
    stream = _long_stream(client, n=SLOTS + QUEUE)  # every slot and queue place taken
    try:
        response = post(
            server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert error(response, 503)["code"] == "queue_full"
        assert int(response.headers["Retry-After"]) >= 1
    finally:
        stream.close()
    _wait_idle(server)
    still_serves(client)


def test_a_client_that_leaves_frees_its_slot(server, client):
    cancelled = server.metric("onegpu_sequences_finished_total", 'reason="cancelled"')
    stream = _long_stream(client, n=1)
    assert server.health()["in_flight"] == 1
    stream.close()  # the connection goes; the server must notice and cancel
    health = _wait_idle(server)
    assert health["kv_positions_used"] == 0
    assert server.metric("onegpu_sequences_finished_total", 'reason="cancelled"') == cancelled + 1
    still_serves(client)


# Not `serial`: the streams need well under a second of the 30 s grace, and a busy neighbour
# only slows what is awaited (the server's start, the streams), never a fixed wait.
@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_then_exits_0(tiny_model_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--served_name", "tiny", "--sync_every", "2"]
    srv = Server(args, tmp_path / "server.log")
    client = openai_client(srv)
    try:
        stream = _long_stream(client, n=4)  # long enough to still run after the signal
        got = {}
        reader = threading.Thread(target=lambda: got.update(chunks=list(stream)), daemon=True)
        reader.start()
        srv.terminate()
        refused_at = _refused(srv)
        reader.join(timeout=120)
        assert srv.proc.wait(timeout=60) == 0, srv.text()
    finally:
        srv.stop()
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in got["chunks"] if c.choices}
    assert set(finished) == {0, 1, 2, 3}
    assert all(finished[i] in ("stop", "length") for i in range(4))  # none cut off
    assert refused_at is not None, "a new request was still accepted after SIGTERM"


def _refused(srv: Server, timeout_s: float = 10):
    """When a new request is turned away (connection refused or 503) after the signal."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 503:
                return time.monotonic()
        except httpx.TransportError:
            return time.monotonic()
        time.sleep(0.05)
    return None


@pytest.mark.slow
def test_a_stream_cut_by_the_grace_period_ends_with_an_error_event_and_done(
    tiny_model_dir, tmp_path
):
    args = ["--model", str(tiny_model_dir), "--served_name", "tiny", "--grace", "0"]
    srv = Server([*args, "--sync_every", "1"], tmp_path / "server.log")
    try:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 240,  # longer than the grace period of 0 s
            "stream": True,
            "ignore_eos": True,
        }
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:
                        srv.terminate()
        assert srv.proc.wait(timeout=60) == 0, srv.text()
    finally:
        srv.stop()
    assert events[-1] == "[DONE]"
    assert '"code": "shutting_down"' in events[-2] and "grace period (0 s)" in events[-2]
    assert "Traceback" not in srv.text() and "CancelledError" not in srv.text()
