"""`onegpu serve` answers OpenAI's API as the engine and `onegpu generate` do: greedy completions
and chat equal generate's, each adapter equals that adapter alone, streams carry the same text
and end with [DONE], n choices, stop strings, concurrent requests that do not disturb each
other, metrics, logprobs and penalties, structured output (response_format, guided_regex and
guided_choice, forced tool calls). One server for the module (a subprocess on 127.0.0.1), called
with the real openai client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_support import Server, make_adapters, openai_client

PROMPTS = ["def add(a, b):", "class Point:", "The quick brown"]
TOKENS = 24
KEY = "test-key"


@pytest.fixture(scope="module")
def adapters(tiny_tokenizer, tmp_path_factory):
    return make_adapters(tiny_tokenizer, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY, "--max_len", "256"]
    args += ["--max_slots", "4", "--queue_size", "8", "--sync_every", "4"]
    for name, folder in adapters.items():
        args += ["--adapter", f"{name}={folder}"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def generated(capsys, tmp_path, model_dir, prompts, *flags) -> list[str]:
    """What `onegpu generate --greedy` answers (in this process, through its CLI)."""
    from onegpu.cli.main import main

    out = tmp_path / "gen.jsonl"
    argv = ["generate", "--model", str(model_dir), "--greedy", "true", "--batch_size", "1"]
    argv += ["--max_new_tokens", str(TOKENS), "--output", str(out), *flags, *prompts]
    assert main(argv) == 0
    capsys.readouterr()
    return [json.loads(line)["text"] for line in out.read_text().splitlines()]


def complete(client, model: str, prompt, **kw):
    kw = {"max_tokens": TOKENS, "temperature": 0, **kw}
    return client.completions.create(model=model, prompt=prompt, **kw)


def test_models_lists_the_base_and_each_adapter(client, tiny_model_dir):
    assert [m.id for m in client.models.list().data] == [str(tiny_model_dir), "alpha", "beta"]


def engine_answers(model_dir, prompts) -> list[str]:
    """What the decode engine gives for these prompts, called directly (no server)."""
    from onegpu.infer import InferConfig, load
    from onegpu.infer.engine import Engine, EngineConfig
    from onegpu.infer.requests import SamplingParams

    loaded = load(InferConfig(model=str(model_dir)))
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_slots=4, max_len=256))
    ids = [loaded.tokenizer(p)["input_ids"] for p in prompts]
    return [r.text for r in engine.generate(ids, SamplingParams(max_new_tokens=TOKENS))]


def test_greedy_completions_equal_generate_and_the_engine(client, tiny_model_dir, capsys, tmp_path):
    expected = generated(capsys, tmp_path, tiny_model_dir, PROMPTS)
    assert engine_answers(tiny_model_dir, PROMPTS) == expected
    # and transformers' own generate, the reference `onegpu generate --decoder hf` keeps
    assert generated(capsys, tmp_path, tiny_model_dir, PROMPTS, "--decoder", "hf") == expected
    one_by_one = [complete(client, str(tiny_model_dir), p).choices[0].text for p in PROMPTS]
    together = complete(client, str(tiny_model_dir), PROMPTS)
    assert one_by_one == expected and any(expected)
    assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == expected
    assert together.usage.completion_tokens <= len(PROMPTS) * TOKENS


def test_each_adapter_answers_as_it_does_alone(client, tiny_model_dir, adapters, capsys, tmp_path):
    answers = {}
    for name, folder in adapters.items():
        alone = generated(capsys, tmp_path, tiny_model_dir, PROMPTS, "--adapter", str(folder))
        served = [complete(client, name, p).choices[0].text for p in PROMPTS]
        assert served == alone, name
        answers[name] = served
    base = [complete(client, str(tiny_model_dir), p).choices[0].text for p in PROMPTS]
    assert answers["alpha"] != answers["beta"] and answers["alpha"] != base  # adapters do act


def test_chat_uses_the_chat_template_as_generate_does(client, tiny_model_dir, capsys, tmp_path):
    expected = generated(capsys, tmp_path, tiny_model_dir, PROMPTS[:2], "--chat", "true")
    for prompt, text in zip(PROMPTS[:2], expected, strict=True):
        reply = client.chat.completions.create(
            model=str(tiny_model_dir),
            messages=[{"role": "user", "content": prompt}],
            max_tokens=TOKENS,
            temperature=0,
        )
        assert reply.choices[0].message.content == text
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_a_stream_carries_the_same_text_and_ends_with_done(client, server, tiny_model_dir):
    whole = complete(client, "alpha", PROMPTS[0])
    chunks = list(complete(client, "alpha", PROMPTS[0], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason
    chat = dict(model="beta", messages=[{"role": "user", "content": "hi"}], temperature=0)
    whole = client.chat.completions.create(max_tokens=TOKENS, **chat)
    stream = client.chat.completions.create(
        max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}, **chat
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "alpha", "prompt": "x", "max_tokens": 4, "stream": True},
        timeout=60,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n") and raw.text.count("data: [DONE]") == 1


def test_n_choices(client, tiny_model_dir):
    model = str(tiny_model_dir)
    single = complete(client, model, PROMPTS[1])
    greedy = complete(client, model, PROMPTS[1], n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {single.choices[0].text}
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    sampled = dict(temperature=1.0, top_p=0.9, n=3, seed=7, max_tokens=12)
    first = complete(client, model, PROMPTS[1], **sampled)
    again = complete(client, model, PROMPTS[1], **sampled)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert len({c.text for c in first.choices}) > 1  # each choice samples on its own


def test_a_stop_string_cuts_the_answer(client, tiny_model_dir):
    full = complete(client, str(tiny_model_dir), PROMPTS[0]).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = complete(client, str(tiny_model_dir), PROMPTS[0], stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_concurrent_requests_each_get_their_own_answer(client, tiny_model_dir):
    """More requests than slots, base and adapters mixed, one long prompt among them: every
    answer equals the one that request gets alone."""
    long_prompt = " ".join(["def add(a, b): return a + b"] * 12)
    jobs = [(m, p) for m in (str(tiny_model_dir), "alpha", "beta") for p in PROMPTS]
    jobs.append(("alpha", long_prompt))
    alone = [complete(client, m, p).choices[0].text for m, p in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: complete(client, *job).choices[0].text, jobs))
    assert together == alone


def test_metrics_count_requests_tokens_and_latency(client, server):
    before = server.metric("onegpu_requests_total", 'route="/v1/completions",status="200"')
    tokens = server.metric("onegpu_generation_tokens_total")
    names = ("onegpu_time_to_first_token_seconds", "onegpu_e2e_request_latency_seconds")
    was = {f"{n}_{k}": server.metric(f"{n}_{k}") for n in names for k in ("count", "sum")}
    started = time.perf_counter()
    reply = complete(client, "beta", PROMPTS[2])
    elapsed = time.perf_counter() - started  # the client's own clock around the request
    after = server.metric("onegpu_requests_total", 'route="/v1/completions",status="200"')
    assert after == before + 1
    assert server.metric("onegpu_generation_tokens_total") == tokens + reply.usage.completion_tokens
    assert server.metric("onegpu_prompt_tokens_total") >= reply.usage.prompt_tokens
    grew = {k: server.metric(k) - v for k, v in was.items()}
    ttft, e2e = names
    # one observation each for this request, the first token before the whole answer, both
    # inside what the client waited
    assert grew[f"{ttft}_count"] == grew[f"{e2e}_count"] == 1
    assert 0 < grew[f"{ttft}_sum"] <= grew[f"{e2e}_sum"] <= elapsed
    # the pool is the budget's, in blocks: at least one sequence of max_len (and more rows' worth
    # at their real lengths); what is held by the running requests is back to 0 after them
    assert server.metric("onegpu_kv_positions_total") == server.health()["kv_positions_total"]
    assert server.metric("onegpu_kv_positions_total") >= 256
    assert server.metric("onegpu_kv_positions_used") == 0
    assert server.metric("onegpu_num_requests_running") == 0


def _post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.url}{path}", headers=headers, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def _events(response: httpx.Response) -> list[dict]:
    lines = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _penalised_reference(model_dir, prompt: list[int], new: int, presence, frequency):
    """Greedy tokens under OpenAI's penalties from full forwards of the saved model, and the
    model's own log-softmax before each: (tokens, [new, vocab])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, rows = [], []
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            rows.append(torch.log_softmax(logits, -1))
            for t in set(tokens):
                logits[t] -= tokens.count(t) * frequency + presence
            tokens.append(int(logits.argmax()))
    return tokens, torch.stack(rows)


def test_completions_carry_the_models_logprobs_and_apply_the_penalties(
    server, tiny_model_dir, tiny_tokenizer
):
    """OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset): the
    model's log-softmax at each greedy, penalised token, the same streamed as whole."""
    import torch

    body = {"model": str(tiny_model_dir), "prompt": PROMPTS[0], "max_tokens": 8}
    body.update(temperature=0, logprobs=3, frequency_penalty=1.0, presence_penalty=0.5)
    body["ignore_eos"] = True
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    prompt = tiny_tokenizer(PROMPTS[0])["input_ids"]
    tokens, ref = _penalised_reference(tiny_model_dir, prompt, 8, 0.5, 1.0)
    assert tokens != _penalised_reference(tiny_model_dir, prompt, 8, 0.0, 0.0)[0]  # they act
    texts = [tiny_tokenizer.decode([t]) for t in tokens]
    assert whole["tokens"] == texts
    want = ref[torch.arange(8), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(whole["token_logprobs"]), want, atol=1e-4, rtol=0)
    for j, top in enumerate(whole["top_logprobs"]):
        values, ids = torch.topk(ref[j], 3)
        want_top: dict = {}  # two ids of one text: the likelier one's logprob
        for i, v in zip(ids.tolist(), values.tolist(), strict=True):
            want_top.setdefault(tiny_tokenizer.decode([i]), v)
        assert set(top) == set(want_top)
        assert all(abs(top[t] - want_top[t]) < 1e-4 for t in top)
    assert whole["text_offset"] == [sum(len(t) for t in texts[:j]) for j in range(8)]
    chunks = _events(_post(server, "/v1/completions", {**body, "stream": True}))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in streamed for x in lp[key]] == whole[key], key


def test_chat_logprobs_have_openais_shape_streamed_and_whole(client, server, tiny_model_dir):
    body = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "hi"}]}
    body.update(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = _post(server, "/v1/chat/completions", body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] > 0
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        first, second = entry["top_logprobs"]
        # greedy: the chosen token is the likeliest one
        assert (first["token"], first["logprob"]) == (entry["token"], entry["logprob"])
        assert second["logprob"] <= first["logprob"]
    chunks = _events(_post(server, "/v1/chat/completions", {**body, "stream": True}))
    streamed = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content
    # the openai client reads them as its own types
    kw = {k: v for k, v in body.items() if k != "model"}
    parsed = client.chat.completions.create(model=str(tiny_model_dir), **kw)
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].logprob == pytest.approx(
        content[0]["top_logprobs"][1]["logprob"]
    )


def test_an_evaluation_scores_a_prompt_with_echo_and_logprobs(
    client, tiny_model_dir, tiny_tokenizer
):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1,
    temperature 0): each prompt token's logprob is the model's, the first has none."""
    import torch
    from transformers import AutoModelForCausalLM

    text = PROMPTS[0] + " and then"
    kw = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    lp = client.completions.create(model=str(tiny_model_dir), prompt=text, **kw).choices[0].logprobs
    ids = tiny_tokenizer(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tiny_tokenizer.decode([t]) for t in ids]
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1 : len(ids)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)  # greedy
