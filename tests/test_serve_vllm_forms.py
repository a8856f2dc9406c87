"""vLLM's request forms against the real engine behind `onegpu serve`, on a model whose chat
template shows no tool format (no --tool_parser): forced tool calls in vLLM's JSON form with a
pydantic schema's ``$defs``, schemas without ``additionalProperties`` that end (closed objects),
logit_bias and min_tokens applied on the device, echo with max_tokens 0, guided_grammar and
structured_outputs, /tokenize. The random tiny model writes no JSON of its own: every valid answer
is the grammar mask's work. One server for the module (a subprocess on 127.0.0.1)."""

from __future__ import annotations

import json
import re

import pytest

from serve_support import Server
from test_serve import KEY, PROMPTS, _events, _post
from test_serve_agent_clients import Report

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY, "--max_len", "256"]
    args += ["--max_slots", "4", "--queue_size", "8", "--sync_every", "4"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


def _chat(model_dir, **kw) -> dict:
    body = {"model": str(model_dir), "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": 160, "temperature": 0, **kw}


def forecast() -> dict:
    """Report's schema as pydantic writes it ($defs for its Enum and nested model, no
    additionalProperties), its strings and list bounded so a random model's answer ends."""
    schema = Report.model_json_schema()
    return {"type": "function", "function": {"name": "forecast", "parameters": schema}}


ECHO = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_forced_calls_in_vllms_json_form_with_defs_whole_and_streamed(
    server, tiny_model_dir, choice
):
    """Before: 400 tools_unsupported (no format in the template), and with a format, 400
    invalid_grammar "Pointer '/$defs/...' does not exist"."""
    tools = [forecast(), ECHO]
    for seed in (0, 1):
        body = _chat(tiny_model_dir, tools=tools, tool_choice=choice, seed=seed, temperature=1.0)
        body["parallel_tool_calls"] = False
        whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls", whole
        [call] = whole["message"]["tool_calls"]
        assert call["function"]["name"] in ("forecast", "echo")
        if call["function"]["name"] == "forecast":
            Report.model_validate_json(call["function"]["arguments"])
        else:
            assert (
                isinstance(json.loads(call["function"]["arguments"]), dict) and choice == "required"
            )
        chunks = _events(_post(server, "/v1/chat/completions", {**body, "stream": True}))
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
        assert deltas[-1]["finish_reason"] == "tool_calls"


def test_a_schema_without_additional_properties_ends_with_its_own_keys(server, tiny_model_dir):
    """pydantic writes no additionalProperties (instructor's JSON_SCHEMA mode sends that): before,
    the model could add keys of its own (here seeds 2 and 3 did, one until max_tokens). Closed,
    each sampled answer ends and holds the listed key alone, if any."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for seed in range(6):
        body = _chat(tiny_model_dir, response_format=fmt, seed=seed, temperature=1.0, max_tokens=60)
        choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        jsonschema.validate(answer, {**schema, "additionalProperties": False})


def test_logit_bias_and_min_tokens_on_the_real_engine(server, tiny_model_dir, tiny_tokenizer):
    base = {"model": str(tiny_model_dir), "prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 0}
    for temperature in (0.0, 1.0):
        held = {**base, "temperature": temperature, "logit_bias": {"42": 100}, "ignore_eos": True}
        lp = _post(server, "/v1/completions", held).json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [tiny_tokenizer.decode([42])] * 6
    eos = tiny_tokenizer.eos_token_id
    to_eos = {**base, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert _post(server, "/v1/completions", to_eos).json()["usage"]["completion_tokens"] <= 1
    held = _post(server, "/v1/completions", {**to_eos, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] >= 4
    assert held["choices"][0]["finish_reason"] == "stop"


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_alone(server, tiny_model_dir):
    body = {"model": str(tiny_model_dir), "prompt": PROMPTS[1], "echo": True, "logprobs": 1}
    scored = _post(server, "/v1/completions", {**body, "max_tokens": 0}).json()
    one = _post(server, "/v1/completions", {**body, "max_tokens": 1, "temperature": 0}).json()
    n = scored["usage"]["prompt_tokens"]
    lp, ref = scored["choices"][0]["logprobs"], one["choices"][0]["logprobs"]
    assert scored["choices"][0]["text"] == PROMPTS[1] and len(lp["tokens"]) == n
    assert lp["token_logprobs"] == ref["token_logprobs"][:n]
    assert scored["usage"]["completion_tokens"] == 0


def test_guided_grammar_and_structured_outputs_answers_match(server, tiny_model_dir):
    lark = 'start: ("yes" | "no") "-" NUM\nNUM: /[0-9]{2}/'
    regex = r"[a-c]{2,4}-[0-9]{3}"
    for seed in (0, 1):
        kw = {"model": str(tiny_model_dir), "prompt": PROMPTS[0], "max_tokens": 40, "seed": seed}
        kw["temperature"] = 1.0
        for extra, pattern in (
            ({"guided_grammar": lark}, r"(yes|no)-[0-9]{2}"),
            ({"structured_outputs": {"grammar": 'root ::= "ab" | "cd"'}}, "ab|cd"),
            ({"structured_outputs": {"regex": regex}}, regex),
            ({"structured_outputs": {"choice": ["red", "blue"]}}, "red|blue"),
        ):
            text = _post(server, "/v1/completions", {**kw, **extra}).json()["choices"][0]["text"]
            assert re.fullmatch(pattern, text), (extra, text)
        shape = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
        text = _post(server, "/v1/completions", {**kw, "structured_outputs": {"json": shape}})
        assert json.loads(text.json()["choices"][0]["text"])["k"] in (1, 2)


def test_tokenize_matches_the_models_tokenizer(server, tiny_tokenizer):
    got = _post(server, "/tokenize", {"prompt": PROMPTS[2]}).json()
    assert got["tokens"] == tiny_tokenizer(PROMPTS[2])["input_ids"]
    back = _post(server, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"]
    assert back == tiny_tokenizer.decode(got["tokens"])
