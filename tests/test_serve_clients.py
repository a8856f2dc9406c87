"""The clients people call servers with, live on loopback against the server's HTTP layer (a
scripted engine behind it, so each answer is known): the openai SDK, LangChain's ChatOpenAI and
LiteLLM, each for a chat, a stream and a tool call. The scripted engine applies no grammar mask
(it declares none), so here each client gets the server's clear 400 naming response_format; the
same clients' JSON-schema answers from the real engine: test_serve_structured.py."""

from __future__ import annotations

import json
import os

import pytest

from serve_fakes import LiveApp, make_service
from test_serve_tools import CALL, HERMES_TEMPLATE, WEATHER

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
ANSWER = "It is sunny."
SCHEMA = {
    "title": "Sky",
    "type": "object",
    "properties": {"sky": {"type": "string"}},
    "required": ["sky"],
}


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = HERMES_TEMPLATE

    def script(prompt: str, params) -> str:
        return CALL if "Tools: weather" in prompt and "result" not in prompt else ANSWER

    service, _ = make_service(tok, script, tool_format="hermes", api_key="k")
    live = LiveApp(service)
    yield live
    live.stop()


def test_openai_sdk_chat_stream_and_tool_call(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        client.chat.completions.create(model="tiny", messages=msgs).choices[0].message.content
        == ANSWER
    )
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage.completion_tokens > 0
    reply = client.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER])
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
    with pytest.raises(BadRequestError) as refused:  # an engine that declares no grammar mask
        client.chat.completions.create(model="tiny", messages=msgs, response_format=fmt)
    assert refused.value.body["param"] == "response_format"


def test_langchain_chat_openai_chat_stream_and_tool_call(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="k", model="tiny", max_retries=0, timeout=30
    )
    assert llm.invoke("hi").content == ANSWER
    assert "".join(chunk.content for chunk in llm.stream("hi")) == ANSWER
    called = llm.bind_tools([WEATHER]).invoke("weather?")
    assert called.tool_calls[0]["name"] == "weather" and called.tool_calls[0]["args"] == {
        "city": "Paris"
    }
    streamed = None
    for chunk in llm.bind_tools([WEATHER]).stream("weather?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["args"] == {"city": "Paris"}
    with pytest.raises(Exception, match="response_format"):
        llm.with_structured_output(SCHEMA, method="json_schema").invoke("sky?")


def test_litellm_chat_stream_and_tool_call(server):
    import litellm

    kw = {"model": "openai/tiny", "api_base": f"{server.url}/v1", "api_key": "k", "timeout": 30}
    msgs = [{"role": "user", "content": "hi"}]
    assert litellm.completion(messages=msgs, **kw).choices[0].message.content == ANSWER
    parts = [
        c.choices[0].delta.content or ""
        for c in litellm.completion(messages=msgs, stream=True, **kw)
    ]
    assert "".join(parts) == ANSWER
    reply = litellm.completion(messages=msgs, tools=[WEATHER], **kw)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    with pytest.raises(litellm.BadRequestError, match="response_format"):
        litellm.completion(messages=msgs, response_format={"type": "json_object"}, **kw)
