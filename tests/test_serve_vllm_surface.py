"""What vLLM's users send beyond OpenAI's core, against the server's HTTP layer (a scripted engine
behind it, so each answer is known): forced tool calls for a model whose template shows no tool
format (vLLM's JSON form, whole and streamed), logit_bias and min_tokens handed to the engine and
their bad values refused by name, completions' echo with max_tokens 0 (the prompt scored, nothing
generated), structured_outputs and guided_grammar as Constraints, /tokenize, /detokenize and
/tokenizer_info."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from serve_fakes import ALL_FEATURES, LiveApp, make_service
from test_serve_api import chat, error_of, post, sse
from test_serve_tools import WEATHER

FEATURES = replace(ALL_FEATURES, bias=True)
CLOCK = {
    "type": "function",
    "function": {"name": "clock", "parameters": {"properties": {"zone": {"enum": ["utc"]}}}},
}


def answer(prompt: str, params) -> str:
    """A forced call's text in vLLM's JSON form, as its grammar makes the real engine write it."""
    c = params.constraint
    if c is None or c.kind != "json_schema" or "weather?" not in prompt:
        return "It is sunny."
    if json.loads(c.value).get("type") == "array":
        return '[{"name": "weather", "parameters": {"city": "Paris"}}]'
    return '{"city": "Paris"}'


@pytest.fixture(scope="module")
def live(tiny_tokenizer):
    """The tiny tokenizer's template shows no tool format (tools.parser_for: None)."""
    service, engine = make_service(tiny_tokenizer, answer, features=FEATURES)
    app = LiveApp(service)
    app.engine = engine
    yield app
    app.stop()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_forced_calls_without_a_tool_format_come_back_as_tool_calls_whole_and_streamed(
    live, choice
):
    """Before, any tools on such a template were a 400 (tools_unsupported)."""
    body = chat("weather?", tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False)
    whole = post(live, "/v1/chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    [call] = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    schema = json.loads(live.engine.seen[-1][1].constraint.value)
    if choice == "required":  # a list of {"name", "parameters"}, one call at most (not parallel)
        assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
        names = [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]]
        assert names == ["weather", "clock"]
    else:  # the named tool's own (closed) schema, as vLLM
        assert schema == {**WEATHER["function"]["parameters"], "additionalProperties": False}
    events = sse(post(live, "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0] for e in events[:-1] if e["choices"]]
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    assert deltas[-1]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


def test_auto_without_a_tool_format_is_a_400_that_says_what_is_needed(live):
    for extra in ({}, {"tool_choice": "auto"}):
        err = error_of(post(live, "/v1/chat/completions", chat(tools=[WEATHER], **extra)), 400)
        assert err["code"] == "tools_unsupported" and err["param"] == "tools"
        assert "--tool_parser" in err["message"] and "'required'" in err["message"]


def test_logit_bias_and_min_tokens_reach_the_engine_and_bad_values_are_refused_by_name(live):
    reply = post(
        live, "/v1/chat/completions", chat(logit_bias={"5": -100, "17": 2.5}, min_tokens=2)
    )
    assert reply.status_code == 200, reply.text
    assert "x-onegpu-ignored-fields" not in reply.headers
    params = live.engine.seen[-1][1]
    assert params.logit_bias == ((5, -100.0), (17, 2.5)) and params.min_tokens == 2
    vocab = len(live.engine.tokenizer)
    cases = [
        ({"logit_bias": {str(vocab): 1}}, f"logit_bias.{vocab}", str(vocab)),
        ({"logit_bias": {"5": 101}}, "logit_bias", "-100..100"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "'x'"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens"),
    ]
    for extra, param, words in cases:
        err = error_of(post(live, "/v1/completions", {"prompt": "x", **extra}), 400)
        assert err["param"] == param and words in err["message"], err


def test_an_engine_without_bias_refuses_it_by_name(tiny_tokenizer):
    service, _ = make_service(tiny_tokenizer, answer, features=ALL_FEATURES)
    app = LiveApp(service)
    try:
        for field, value in (("logit_bias", {"5": 1}), ("min_tokens", 3)):
            err = error_of(post(app, "/v1/completions", {"prompt": "x", field: value}), 400)
            assert err["param"] == field and err["code"] == "unsupported_parameter"
    finally:
        app.stop()


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(live):
    body = {"prompt": "x y", "echo": True, "logprobs": 1, "max_tokens": 0}
    reply = post(live, "/v1/completions", body).json()
    choice, n = reply["choices"][0], reply["usage"]["prompt_tokens"]
    assert choice["text"] == "x y" and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"] == [None] + [-0.5] * (n - 1)
    events = sse(post(live, "/v1/completions", {**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == "x y"
    streamed = [
        t for e in events[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])
    ]
    assert streamed == lp["tokens"]
    err = error_of(post(live, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens" and "echo" in err["message"]


@pytest.mark.parametrize(
    "extra, kind, value",
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", '{"type": "object"}'),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", '["a", "b"]'),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar", 'start: "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_schema", ""),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ],
)
def test_structured_outputs_and_guided_grammar_become_the_engines_constraint(
    live, extra, kind, value
):
    reply = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 4, **extra})
    assert reply.status_code == 200, reply.text
    assert "x-onegpu-ignored-fields" not in reply.headers
    c = live.engine.seen[-1][1].constraint
    assert (c.kind, c.value) == (kind, value)


def test_two_structured_outputs_at_once_are_a_400(live):
    both = {"structured_outputs": {"regex": "a", "choice": ["a"]}}
    err = error_of(post(live, "/v1/completions", {"prompt": "x", **both}), 400)
    assert err["param"] == "structured_outputs.choice"
    err = error_of(
        post(live, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_grammar": "x"}),
        400,
    )
    assert err["param"] == "guided_grammar"


def test_tokenize_and_detokenize_as_vllm(live, tiny_tokenizer):
    reply = post(live, "/tokenize", {"prompt": "def add(a, b):", "return_token_strs": True}).json()
    ids = tiny_tokenizer("def add(a, b):")["input_ids"]
    assert reply["tokens"] == ids and reply["count"] == len(ids)
    assert reply["max_model_len"] == live.engine.max_len
    assert reply["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(ids)
    back = post(live, "/detokenize", {"tokens": reply["tokens"]}).json()
    assert back == {"prompt": tiny_tokenizer.decode(ids)}
    msgs = [{"role": "user", "content": "hi"}]
    chat_ids = post(live, "/tokenize", {"messages": msgs}).json()["tokens"]
    text = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat_ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    err = error_of(post(live, "/detokenize", {"tokens": [len(tiny_tokenizer)]}), 400)
    assert err["param"] == "tokens"
    err = error_of(post(live, "/tokenize", {"prompt": "x", "messages": msgs}), 400)
    assert "one of them" in err["message"]
    assert post(live, "/tokenize", {"prompt": "x", "model": "nope"}).status_code == 404


def test_tokenizer_info_as_vllm_and_as_lm_eval_probes_it(live, tiny_tokenizer):
    """vLLM's shape (the tokenizer's settings, its class, its chat template), no server paths;
    lm-eval's local-completions takes it for a remote tokenizer (before: a 404, and lm-eval fell
    back to loading the tokenizer itself by the model's name)."""
    info = httpx.get(f"{live.url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tiny_tokenizer).__name__
    assert info["chat_template"] == tiny_tokenizer.chat_template
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert info[name] == getattr(tiny_tokenizer, name)
    assert info["extra_special_tokens"] == tiny_tokenizer.init_kwargs["extra_special_tokens"]
    assert not {"name_or_path", "vocab_file", "merges_file", "tokenizer_file"} & set(info)
    lm_utils = pytest.importorskip("lm_eval.utils")
    assert lm_utils.check_remote_tokenizer_support(live.url + "/v1/completions")
    remote = lm_utils.RemoteTokenizer(live.url + "/v1/completions")
    assert remote.eos_token_id == tiny_tokenizer.eos_token_id
    assert remote.bos_token_id == tiny_tokenizer.bos_token_id
    text = "def add(a, b): return a + b"
    assert remote.encode(text) == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert remote.decode(remote.encode(text)) == tiny_tokenizer.decode(remote.encode(text))


def test_tokenizer_info_needs_the_api_key_like_the_other_routes(tiny_tokenizer):
    service, _ = make_service(tiny_tokenizer, answer, api_key="k3y")
    app = LiveApp(service)
    try:
        url = f"{app.url}/tokenizer_info"
        assert error_of(httpx.get(url, timeout=30), 401)["code"] == "invalid_api_key"
        ok = httpx.get(url, headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["eos_token"] == tiny_tokenizer.eos_token
    finally:
        app.stop()


def test_tokenizer_info_reads_the_special_tokens_as_they_are_now(tiny_tokenizer):
    """A pad token set after loading is on the tokenizer only, not in its init_kwargs."""
    from onegpu.serve.tokens import tokenizer_info

    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.pad_token = tok.eos_token
    assert tok.init_kwargs["pad_token"].content == "<|pad|>"  # as it was built
    assert tokenizer_info(tok)["pad_token"] == tok.eos_token


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_strict_reaches_the_engines_grammar(tiny_tokenizer, strict):
    """--json_schema_strict (launch.add_request_features): on, an object that leaves
    additionalProperties out is closed in the grammar the engine gets; off, it goes as sent."""
    from onegpu.serve.config import ServeConfig
    from onegpu.serve.launch import add_request_features

    service, engine = make_service(tiny_tokenizer, answer, features=FEATURES)
    add_request_features(service, tiny_tokenizer, ServeConfig(json_schema_strict=strict))
    app = LiveApp(service)
    try:
        sky = {"type": "object", "properties": {"sky": {"type": "string"}}}
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": sky}}
        for body in ({"response_format": fmt}, {"guided_json": sky}):
            reply = post(app, "/v1/chat/completions", chat(max_tokens=4, **body))
            assert reply.status_code == 200, reply.text
            sent = json.loads(engine.seen[-1][1].constraint.value)
            assert sent == ({**sky, "additionalProperties": False} if strict else sky)
    finally:
        app.stop()
