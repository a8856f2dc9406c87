"""Tool calls: the format read from the chat template, the tools rendered into it, the answer read
back into OpenAI's tool_calls (Hermes/Qwen and Llama 3 formats), whole and streamed, tool results
and earlier calls accepted back, and forced calls built as grammars."""

from __future__ import annotations

import json
import threading

import pytest

from onegpu.serve.tools import HermesReader, Llama3Reader, parser_for
from serve_fakes import LiveApp, make_service
from test_serve_api import chat, error_of, post, sse

HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "Call one as <tool_call>{json}</tool_call><|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] }}</tool_call>{% endfor %}<|eos|>"
    "{% elif m['role'] == 'tool' %}<|user|>result {{ m['content'] }}<|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_the_format_is_read_from_the_template_or_the_flag():
    assert parser_for(HERMES_TEMPLATE) == "hermes"
    assert parser_for('{{ "<|python_tag|>" }}') == "llama3"
    assert parser_for("{{ messages }}") is None
    assert parser_for("{{ messages }}", "hermes") == "hermes"
    assert parser_for(HERMES_TEMPLATE, "none") is None


def test_hermes_calls_split_from_content_whatever_the_chunking():
    answer = f"Let me look. {CALL} and {CALL.replace('Paris', 'Oslo')}"
    for size in (1, 3, 7, len(answer)):
        reader, content, calls = HermesReader(), "", []
        for i in range(0, len(answer), size):
            text, new = reader.feed(answer[i : i + size])
            content, calls = content + text, calls + new
        rest, _ = reader.finish()
        assert content + rest == "Let me look.  and "
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
        assert len({c.id for c in calls}) == 2
    reader = HermesReader()
    text, calls = reader.feed("<tool_call>not json</tool_call> x <tool")
    assert calls == [] and text == "<tool_call>not json</tool_call> x "
    assert reader.finish() == ("<tool", [])  # an unclosed tag at the end is the model's text


def test_llama3_json_calls_and_plain_answers():
    reader = Llama3Reader()
    body = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
    body += '{"name": "b", "parameters": {"s": ";}"}}'
    assert reader.feed(body[:5]) == ("", []) and reader.feed(body[5:]) == ("", [])
    content, calls = reader.finish()
    assert content == "" and [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].arguments) == {"s": ";}"}
    plain = Llama3Reader()
    assert plain.feed("Hello") == ("Hello", []) and plain.feed(" {x}") == (" {x}", [])
    broken = Llama3Reader()
    broken.feed('{"not": "a call"}')
    assert broken.finish() == ('{"not": "a call"}', [])


@pytest.fixture
def hermes_app(tiny_tokenizer):
    tok = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tok.chat_template = HERMES_TEMPLATE

    def script(prompt: str, params) -> str:
        return CALL if "Tools: weather" in prompt and "result" not in prompt else "It is sunny."

    service, engine = make_service(tok, script, tool_format="hermes")
    live = LiveApp(service)
    live.engine = engine
    yield live
    live.stop()


def test_a_tool_call_comes_back_as_tool_calls(hermes_app):
    reply = post(hermes_app, "/v1/chat/completions", chat("weather?", tools=[WEATHER])).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert "Tools: weather" in hermes_app.engine.seen[-1][0]  # the tools went into the template


def test_a_streamed_tool_call_comes_as_openais_deltas(hermes_app):
    events = sse(
        post(hermes_app, "/v1/chat/completions", chat("weather?", tools=[WEATHER], stream=True))
    )
    assert events[-1] == "[DONE]"
    deltas = [c["choices"][0] for c in events[:-1]]
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert "".join(d["delta"].get("content", "") for d in deltas) == ""  # no tag leaks as text
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_tool_results_and_earlier_calls_are_accepted_back(hermes_app):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    reply = post(
        hermes_app, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER]}
    ).json()
    assert reply["choices"][0]["message"]["content"] == "It is sunny."
    prompt = hermes_app.engine.seen[-1][0]
    assert "<tool_call>weather Oslo</tool_call>" in prompt and "result 12 C" in prompt


def test_tool_choice_none_keeps_tools_out_and_reads_no_calls(hermes_app):
    reply = post(
        hermes_app, "/v1/chat/completions", chat("weather?", tools=[WEATHER], tool_choice="none")
    )
    assert "Tools:" not in hermes_app.engine.seen[-1][0]
    assert reply.json()["choices"][0]["message"]["content"] == "It is sunny."


def test_forced_tool_choice_needs_an_engine_with_grammars_and_names_unknown_tools(hermes_app):
    """An engine that declares no grammars refuses a forced call by name (the decode engine
    declares them: tests/test_serve.py runs forced calls end to end)."""
    named = {"type": "function", "function": {"name": "weather"}}
    for choice in ("required", named):
        err = error_of(
            post(hermes_app, "/v1/chat/completions", chat(tools=[WEATHER], tool_choice=choice)), 400
        )
        assert err["param"] == "tool_choice" and err["code"] == "unsupported_parameter"
    err = error_of(post(hermes_app, "/v1/chat/completions", chat(tool_choice="required")), 400)
    assert err["param"] == "tool_choice" and "no 'tools'" in err["message"]
    other = {"type": "function", "function": {"name": "nope"}}
    err = error_of(
        post(hermes_app, "/v1/chat/completions", chat(tools=[WEATHER], tool_choice=other)), 400
    )
    assert "nope" in err["message"] and "weather" in err["message"]


def test_tools_on_a_template_without_a_format_are_a_400(tiny_tokenizer):
    service, _ = make_service(tiny_tokenizer, lambda p, s: "x")
    live = LiveApp(service)
    try:
        err = error_of(post(live, "/v1/chat/completions", chat(tools=[WEATHER])), 400)
        assert err["param"] == "tools" and "--tool_parser" in err["message"]
    finally:
        live.stop()


def test_one_bad_request_does_not_disturb_a_concurrent_stream(hermes_app):
    got = {}
    streaming = threading.Thread(
        target=lambda: got.update(
            r=post(
                hermes_app, "/v1/chat/completions", chat("weather?", tools=[WEATHER], stream=True)
            )
        )
    )
    streaming.start()
    assert error_of(post(hermes_app, "/v1/chat/completions", {"messages": [{"role": "tool"}]}), 400)
    streaming.join()
    assert sse(got["r"])[-1] == "[DONE]"
