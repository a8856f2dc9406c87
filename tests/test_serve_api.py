"""The server accepts what OpenAI and vLLM accept, answers every failure with OpenAI's error object,
and isolates what it can: run in-process (uvicorn on a thread, 127.0.0.1) around a scripted engine,
so each test shows one behaviour of the HTTP layer in well under a second."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from serve_fakes import ALL_FEATURES, CRASH, FAIL, LiveApp, make_service

HELLO = "hello there"


def hello(prompt: str, params) -> str:
    if "failme" in prompt:
        return FAIL
    if "crashme" in prompt:
        return CRASH
    return HELLO


@pytest.fixture
def app(tiny_tokenizer):
    service, engine = make_service(tiny_tokenizer, hello)
    live = LiveApp(service)
    live.engine, live.service = engine, service
    yield live
    live.stop()


def post(app, path: str, body, headers=None, **kw) -> httpx.Response:
    return httpx.post(f"{app.url}{path}", json=body, headers=headers or {}, timeout=30, **kw)


def chat(content: str = "hi", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def sse(response: httpx.Response) -> list:
    """The data of each server-sent event ([DONE] as the string)."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------------- lenient
def test_unknown_fields_are_ignored_logged_once_and_named_in_a_header(app, caplog):
    body = chat(prediction={"type": "content", "content": "x"}, store=True, metadata={"a": "b"})
    body["messages"][0]["refusal"] = None
    with caplog.at_level(logging.WARNING, logger="onegpu.serve.app"):
        first = post(app, "/v1/chat/completions", body)
        second = post(app, "/v1/chat/completions", body)
    assert first.status_code == 200 and second.status_code == 200, first.text
    named = first.headers["x-onegpu-ignored-fields"]
    assert named == "messages.refusal, metadata, prediction, store"
    assert second.headers["x-onegpu-ignored-fields"] == named
    warned = [
        r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()
    ]
    assert len(warned) == 4  # one line per name, not per request
    assert "x-onegpu-ignored-fields" not in post(app, "/v1/chat/completions", chat()).headers


def test_guidellms_stream_options_and_whole_number_floats_are_accepted(app):
    body = {
        "model": "tiny",
        "prompt": "def",
        "max_tokens": 4.0,
        "n": 1.0,
        "seed": -1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    response = post(app, "/v1/completions", body)
    events = sse(response)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" in c for c in chunks)  # continuous: every chunk carries the usage so far
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert chunks[-1]["choices"] == []  # include_usage: the final usage chunk
    assert (
        error_of(post(app, "/v1/completions", {**body, "max_tokens": 4.5}), 400)["param"]
        == "max_tokens"
    )


def test_seed_takes_any_64_bit_integer_and_minus_one_repeats(app):
    for seed in (-1, -(2**63), 2**63 - 1):
        assert (
            post(app, "/v1/completions", {"prompt": "x", "seed": seed, "max_tokens": 1}).status_code
            == 200
        )
    seeds = [p.seed for _, p in app.engine.seen[-3:]]
    assert all(0 <= s < 2**63 for s in seeds)
    post(app, "/v1/completions", {"prompt": "x", "seed": -1, "max_tokens": 1})
    assert app.engine.seen[-1][1].seed == seeds[0]  # the same seed samples the same way
    assert (
        error_of(post(app, "/v1/completions", {"prompt": "x", "seed": 2**63}), 400)["param"]
        == "seed"
    )


def test_model_may_be_left_out_and_the_base_answers(app):
    reply = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"
    assert reply.json()["choices"][0]["message"]["content"] == HELLO


def test_echo_puts_the_prompt_before_the_answer(app):
    whole = post(app, "/v1/completions", {"prompt": "def f", "echo": True, "max_tokens": 8}).json()
    assert whole["choices"][0]["text"] == "def f" + HELLO
    streamed = sse(post(app, "/v1/completions", {"prompt": "def f", "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == "def f" + HELLO


def test_penalties_and_logprobs_reach_the_engines_sampling_params(tiny_tokenizer):
    service, engine = make_service(tiny_tokenizer, hello, features=ALL_FEATURES)
    live = LiveApp(service)
    try:
        body = chat(presence_penalty=0.5, frequency_penalty=-1, logprobs=True, top_logprobs=2)
        reply = post(live, "/v1/chat/completions", body).json()
        params = engine.seen[-1][1]
        assert (params.presence_penalty, params.frequency_penalty, params.logprobs) == (0.5, -1, 2)
        content = reply["choices"][0]["logprobs"]["content"]
        assert len(content) == reply["usage"]["completion_tokens"]
        assert [len(t["top_logprobs"]) for t in content] == [2] * len(content)
        assert content[0]["logprob"] == -0.25 and content[0]["bytes"] == list(
            content[0]["token"].encode()
        )
        text = post(live, "/v1/completions", {"prompt": "x", "logprobs": 3, "max_tokens": 3}).json()
        lp = text["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
        assert lp["text_offset"][0] == 0 and all(len(t) == 3 for t in lp["top_logprobs"])
        # echoed: the prompt's tokens first (the first without a logprob), then the answer's;
        # streamed, the prompt's come with the echo and each offset counts on from the earlier
        echoed = {"prompt": "x y", "logprobs": 1, "max_tokens": 3, "echo": True}
        reply = post(live, "/v1/completions", echoed).json()
        whole, n = reply["choices"][0]["logprobs"], reply["usage"]["prompt_tokens"]
        assert engine.seen[-1][1].prompt_logprobs == 1 and n >= 2
        assert "".join(whole["tokens"][:n]).strip() == "x y"
        assert whole["token_logprobs"] == [None] + [-0.5] * (n - 1) + [-0.25] * 3
        assert whole["top_logprobs"][0] is None and len(whole["top_logprobs"][1]) == 1
        assert whole["text_offset"][0] == 0 and whole["text_offset"][n] == len("x y")
        chunks = sse(post(live, "/v1/completions", {**echoed, "stream": True}))[:-1]
        assert chunks[0]["choices"][0]["text"] == "x y"
        streamed = [
            o
            for c in chunks
            if c["choices"][0]["logprobs"]
            for o in c["choices"][0]["logprobs"]["text_offset"]
        ]
        assert streamed == whole["text_offset"]
        streamed = sse(post(live, "/v1/chat/completions", {**body, "stream": True}))
        got = [
            t
            for c in streamed[1:-1]
            if c["choices"][0]["logprobs"]
            for t in c["choices"][0]["logprobs"]["content"]
        ]
        assert len(got) == len(content)
    finally:
        live.stop()


@pytest.mark.parametrize(
    "extra,param,applied",
    [
        ({"presence_penalty": 0.5}, "presence_penalty", True),
        ({"frequency_penalty": 1}, "frequency_penalty", True),
        ({"logprobs": True}, "logprobs", True),
        ({"response_format": {"type": "json_object"}}, "response_format", True),
        ({"guided_choice": ["a", "b"]}, "guided_choice", True),
        ({"guided_regex": "[ab]+"}, "guided_regex", True),
    ],
)
def test_what_the_engine_does_not_apply_is_refused_by_name(
    app, tiny_tokenizer, extra, param, applied
):
    """An engine that declares nothing refuses each field by name; the decode engine's own
    declaration (penalties, logprobs and grammars applied) lets them through."""
    from onegpu.infer.engine import FEATURES

    err = error_of(post(app, "/v1/chat/completions", chat(**extra)), 400)
    assert err["param"] == param and err["code"] == "unsupported_parameter"
    assert (
        post(app, "/v1/chat/completions", chat(presence_penalty=0, logprobs=False)).status_code
        == 200
    )
    service, _ = make_service(tiny_tokenizer, hello, features=FEATURES)
    live = LiveApp(service)
    try:
        response = post(live, "/v1/chat/completions", chat(**extra))
        if applied:
            assert response.status_code == 200, response.text
        else:
            assert error_of(response, 400)["code"] == "unsupported_parameter"
    finally:
        live.stop()


def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(app):
    pytest.importorskip("llguidance")
    from onegpu.infer.constraints import Grammars

    app.service.check_constraint = Grammars(app.service.tokenizer).check
    err = error_of(post(app, "/v1/chat/completions", chat(guided_regex="([")), 400)
    assert err["param"] == "guided_regex" and err["code"] == "invalid_grammar"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    err = error_of(post(app, "/v1/chat/completions", chat(response_format=schema)), 400)
    assert err["param"] == "response_format" and "wat" in err["message"]


# ---------------------------------------------------------------------------- errors
def test_a_chat_template_that_raises_is_a_400_error_object(app):
    tok = app.service.tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ raise_exception('this model takes no system messages') }}"
    try:
        err = error_of(post(app, "/v1/chat/completions", chat()), 400)
    finally:
        tok.chat_template = saved
    assert err["code"] == "chat_template_error" and "no system messages" in err["message"]
    assert post(app, "/v1/chat/completions", chat()).status_code == 200


def test_a_non_ascii_bearer_token_is_a_401_error_object(tiny_tokenizer):
    service, _ = make_service(tiny_tokenizer, hello, api_key="s3cret")
    live = LiveApp(service)
    try:
        for token in ("sécret", "s3cret\u2603", "s3cre"):
            headers = [(b"authorization", b"Bearer " + token.encode("utf-8"))]
            response = httpx.get(f"{live.url}/v1/models", headers=headers, timeout=10)
            assert error_of(response, 401)["code"] == "invalid_api_key"
        ok = httpx.get(
            f"{live.url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=10
        )
        assert ok.status_code == 200
    finally:
        live.stop()


@pytest.mark.parametrize(
    "raw,words",
    [
        (b'{"prompt": "a\\ud800b"}', "surrogate"),  # no tokenizer takes half a character
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ],
)
def test_bodies_that_would_break_the_parser_or_the_tokenizer_are_400s(app, raw, words):
    response = httpx.post(f"{app.url}/v1/completions", content=raw, timeout=30)
    assert words in error_of(response, 400)["message"]


def test_unknown_routes_and_methods_answer_error_objects(app):
    assert (
        error_of(httpx.get(f"{app.url}/v1/nothing", timeout=10), 404)["type"] == "not_found_error"
    )
    assert error_of(httpx.get(f"{app.url}/v1/completions", timeout=10), 405)["code"] == "405"


def test_a_request_the_engine_fails_alone_fails_alone(app):
    results = {}

    def ask(name: str, content: str):
        results[name] = post(app, "/v1/chat/completions", chat(content, max_tokens=30))

    threads = [
        threading.Thread(target=ask, args=(n, c)) for n, c in [("ok", "hi"), ("bad", "failme")]
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert error_of(results["bad"], 500)["message"] == "this request failed: injected fault"
    assert results["ok"].json()["choices"][0]["message"]["content"] == HELLO
    streamed = sse(post(app, "/v1/chat/completions", chat("failme", stream=True)))
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["type"] == "server_error"
    assert app.service.scheduler.health().in_flight == 0


def test_a_cut_ends_each_stream_with_an_error_event_and_done(tiny_tokenizer):
    service, engine = make_service(tiny_tokenizer, lambda p, s: "word " * 200, step_s=0.02)
    live = LiveApp(service)
    try:
        got = {}
        reader = threading.Thread(
            target=lambda: got.update(
                r=post(live, "/v1/chat/completions", chat(stream=True, max_tokens=300))
            )
        )
        reader.start()
        deadline = time.monotonic() + 10
        while not engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        service.scheduler.cut("the grace period ran out.")
        reader.join(timeout=30)
        events = sse(got["r"])
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
    finally:
        live.stop()


class SlowTemplate:
    """The tokenizer, with a chat template that takes a second and notes the thread it ran on."""

    def __init__(self, tokenizer):
        self.tokenizer, self.threads = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self):
        return len(self.tokenizer)

    def __call__(self, *args, **kw):
        return self.tokenizer(*args, **kw)

    def apply_chat_template(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        time.sleep(1.0)
        return self.tokenizer.apply_chat_template(*args, **kw)


def test_templating_runs_off_the_event_loop(tiny_tokenizer):
    """While a template takes a second, /health answers at once; the template ran on the
    tokenizer thread."""
    slow = SlowTemplate(tiny_tokenizer)
    service, _ = make_service(slow, hello)
    live = LiveApp(service)
    try:
        asking = threading.Thread(target=post, args=(live, "/v1/chat/completions", chat()))
        asking.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
        waited = time.perf_counter() - t0
        asking.join()
    finally:
        live.stop()
    assert waited < 0.5 and slow.threads and slow.threads[0].startswith("tokenize")


# ---------------------------------------------------------------------------- openapi
def test_openapi_publishes_bodies_and_errors_and_not_metrics(app):
    spec = httpx.get(f"{app.url}/openapi.json", timeout=10).json()
    assert "/metrics" not in spec["paths"]
    chat_op = spec["paths"]["/v1/chat/completions"]["post"]
    ref = chat_op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ChatRequest")
    schemas = spec["components"]["schemas"]
    assert {"messages", "tools", "response_format", "logprobs"} <= set(
        schemas["ChatRequest"]["properties"]
    )
    assert {"200", "400", "401", "404", "500", "503"} <= set(chat_op["responses"])
    err = chat_op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert err.endswith("/ErrorResponse")
    assert set(chat_op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


def test_a_prompt_of_token_ids_or_a_batch_of_them_is_accepted(app, tiny_tokenizer):
    """OpenAI's four prompt forms; lm-evaluation-harness sends a batch of token-id lists."""
    ids = [tiny_tokenizer("def f")["input_ids"], tiny_tokenizer("x = 1")["input_ids"]]
    one = post(app, "/v1/completions", {"prompt": ids[0], "max_tokens": 2}).json()
    assert len(one["choices"]) == 1 and HELLO.startswith(one["choices"][0]["text"])
    batch = post(app, "/v1/completions", {"prompt": ids, "max_tokens": 2}).json()
    assert len(batch["choices"]) == 2
    assert [text for text, _ in app.engine.seen[-2:]] == [tiny_tokenizer.decode(i) for i in ids]
    assert batch["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    for bad in ([ids[0], []], [[0, 10**6]], [[1, -3]]):
        assert error_of(post(app, "/v1/completions", {"prompt": bad}), 400)["param"] == "prompt"
