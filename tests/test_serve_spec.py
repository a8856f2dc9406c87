"""`onegpu serve --speculative ngram` answers as the same requests do without speculation (here:
`onegpu generate` without it), alone and concurrently, and /metrics counts the proposals and
acceptances (onegpu_spec_decode_*) — so the flag reached the engine; `onegpu generate
--speculative ngram` answers the same too."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_support import Server, openai_client

# prompts that repeat themselves: the tiny model's greedy answers repeat them, so proposals are
# made and accepted
PROMPTS = [
    "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add(",
    "import os\nimport os\nimport os\nimport",
    "the cat sat on the mat. the cat sat on the mat. the cat",
]
TOKENS = 32
KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model", str(tiny_model_dir), "--api_key", KEY, "--max_len", "256"]
    args += ["--max_slots", "3", "--speculative", "ngram", "--num_speculative_tokens", "3"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


def _generated(capsys, tmp_path, model_dir, *flags) -> list[str]:
    from onegpu.cli.main import main

    out = tmp_path / "gen.jsonl"
    argv = ["generate", "--model", str(model_dir), "--greedy", "true", "--batch_size", "1"]
    argv += ["--max_new_tokens", str(TOKENS), "--output", str(out), *flags, *PROMPTS]
    assert main(argv) == 0
    capsys.readouterr()
    return [json.loads(line)["text"] for line in out.read_text().splitlines()]


def test_answers_with_speculation_equal_those_without(server, tiny_model_dir, capsys, tmp_path):
    client = openai_client(server, KEY)
    plain = _generated(capsys, tmp_path, tiny_model_dir)
    assert _generated(capsys, tmp_path, tiny_model_dir, "--speculative", "ngram") == plain

    def ask(prompt: str) -> str:
        reply = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
        )
        return reply.choices[0].text

    assert [ask(p) for p in PROMPTS] == plain
    with ThreadPoolExecutor(3) as pool:  # at once: verified rows beside each other
        assert list(pool.map(ask, PROMPTS * 2)) == plain * 2
    drafts = server.metric("onegpu_spec_decode_num_drafts_total")
    proposed = server.metric("onegpu_spec_decode_num_draft_tokens_total")
    accepted = server.metric("onegpu_spec_decode_num_accepted_tokens_total")
    first = server.metric("onegpu_spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    assert 0 < first <= drafts
