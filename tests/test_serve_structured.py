"""Structured output from the real engine behind `onegpu serve`: response_format (json_schema,
json_object), guided_regex/guided_choice/guided_json and forced tool calls, whole and streamed, and
the clients people call a server with (the openai SDK, LangChain's ChatOpenAI, LiteLLM) getting
JSON-schema answers. The random tiny model writes no JSON of its own: every valid answer is the
grammar mask's work. One server for the module (a subprocess on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from serve_support import Server, openai_client
from test_serve import KEY, PROMPTS, _events, _post

pytest.importorskip("llguidance")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY, "--max_len", "256"]
    args += ["--max_slots", "4", "--queue_size", "8", "--sync_every", "4"]
    args += ["--tool_parser", "hermes"]  # the tiny template shows no format: forced calls' tags
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "home"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": ZONE}}


def _chat(tiny_model_dir, **kw) -> dict:
    body = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": 120, "temperature": 0, **kw}


def _streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_response_format_json_schema_answers_validate_whole_and_streamed(
    client, server, tiny_model_dir
):
    """The random tiny model writes no JSON of its own; with response_format its answer is JSON
    its schema accepts, streamed as whole (one token a step, sync_every 4 notwithstanding)."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": PERSON}}
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        body = _chat(tiny_model_dir, response_format=fmt, seed=seed, temperature=temperature)
        whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]
        assert whole["finish_reason"] == "stop"
        jsonschema.validate(json.loads(whole["message"]["content"]), PERSON)
        chunks = _events(_post(server, "/v1/chat/completions", {**body, "stream": True}))
        assert _streamed_text(chunks) == whole["message"]["content"]
    plain = client.chat.completions.create(
        model=str(tiny_model_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=40
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content)
    # any JSON object, through the openai client (an unbounded grammar: a seed whose draw ends
    # within the limit with a key and a value)
    reply = client.chat.completions.create(
        model=str(tiny_model_dir),
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=1.0,
        seed=2,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert len(json.loads(reply.choices[0].message.content)) == 1
    # a schema its limit cuts short: "length", the JSON unfinished, as OpenAI's
    short = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}}
    short["required"] = ["s"]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": short}}
    cut = _post(
        server, "/v1/chat/completions", _chat(tiny_model_dir, response_format=fmt, max_tokens=6)
    )
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    # a schema that does not compile: one 400 naming the field, before any engine work
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "wat"}}}
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json=_chat(tiny_model_dir, response_format=bad),
        timeout=60,
    )
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert (err["param"], err["code"]) == ("response_format", "invalid_grammar")


def test_guided_regex_choice_and_json_answers_match(client, tiny_model_dir):
    regex, choices = r"[a-c]{2,4}-[0-9]{3}", ["yes", "no", "maybe not"]
    for seed in (0, 1):
        kw = dict(model=str(tiny_model_dir), prompt=PROMPTS[0], max_tokens=40, seed=seed)
        text = client.completions.create(**kw, extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, text.choices[0].text), text.choices[0].text
        pick = client.completions.create(**kw, extra_body={"guided_choice": choices})
        assert pick.choices[0].text in choices and pick.choices[0].finish_reason == "stop"
        tags = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}
        listed = client.completions.create(**kw, extra_body={"guided_json": tags})
        assert set(json.loads(listed.choices[0].text)) <= {"a", "b"}


def test_a_forced_tool_call_comes_back_as_tool_calls_whole_and_streamed(server, tiny_model_dir):
    """tool_choice naming a function, and "required" among two: the answer is one call (the
    Hermes tags around it, --tool_parser hermes) whose arguments follow the tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    named = {"type": "function", "function": {"name": "weather"}}
    for choice, tools in ((named, [CLOCK, WEATHER]), ("required", [WEATHER, CLOCK])):
        body = _chat(tiny_model_dir, tools=tools, tool_choice=choice, max_tokens=160)
        whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
        [call] = whole["message"]["tool_calls"]
        assert call["function"]["name"] in ("weather", "clock")
        schema = (WEATHER if call["function"]["name"] == "weather" else CLOCK)["function"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema["parameters"])
        if choice is named:
            assert call["function"]["name"] == "weather"
        chunks = _events(_post(server, "/v1/chat/completions", {**body, "stream": True}))
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"


SKY = {
    "title": "Sky",
    "type": "object",
    "properties": {"sky": {"type": "string", "maxLength": 12}},
    "required": ["sky"],
    "additionalProperties": False,
}


def test_the_clients_get_json_schema_answers(client, server, tiny_model_dir):
    """The openai SDK's parse, LangChain's with_structured_output and LiteLLM's response_format,
    each against the real engine: a value of the schema's shape, not the model's free text."""
    jsonschema = pytest.importorskip("jsonschema")
    import litellm
    from langchain_openai import ChatOpenAI

    model, msgs = str(tiny_model_dir), [{"role": "user", "content": "sky?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "Sky", "strict": True, "schema": SKY}}
    reply = client.chat.completions.create(
        model=model, messages=msgs, response_format=fmt, max_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SKY)
    llm = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, model=model, max_retries=0, timeout=60,
        temperature=0, max_tokens=60,
    )  # fmt: skip
    sky = llm.with_structured_output(SKY, method="json_schema").invoke("sky?")
    jsonschema.validate(sky, SKY)
    got = litellm.completion(
        model=f"openai/{model}", api_base=f"{server.url}/v1", api_key=KEY, timeout=60,
        messages=msgs, response_format=fmt, max_tokens=60, temperature=0,
    )  # fmt: skip
    jsonschema.validate(json.loads(got.choices[0].message.content), SKY)
