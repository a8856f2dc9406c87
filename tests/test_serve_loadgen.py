"""guidellm, vLLM's load generator, against `onegpu serve`: its request bodies at its defaults
(streamed chat with stream_options include_usage and continuous_usage_stats, ``stop: null``,
``ignore_eos``) are answered, and a bounded run of the real guidellm CLI ends with 0 errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_fakes import LiveApp, make_service
from serve_support import Server
from test_serve_api import post, sse


def test_guidellms_default_chat_body_streams_with_usage_in_every_chunk(tiny_tokenizer):
    service, _ = make_service(tiny_tokenizer, lambda p, s: "word " * 50)
    live = LiveApp(service)
    try:
        body = {  # as guidellm 0.8.1's ChatCompletionsRequestHandler writes it
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 12,
            "max_completion_tokens": 12,
            "stop": None,
            "ignore_eos": True,
        }
        events = sse(post(live, "/v1/chat/completions", body))
    finally:
        live.stop()
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
    assert all("usage" in e for e in events[:-1])


@pytest.mark.slow
def test_guidellm_at_its_defaults_runs_with_no_errors(tiny_model_dir, tmp_path):
    guidellm = Path(sys.executable).with_name("guidellm")
    if not guidellm.exists():
        pytest.skip("guidellm is not installed (pip install 'onegpu[test]')")
    model = str(tiny_model_dir)
    srv = Server(["--model", model, "--max_len", "256"], tmp_path / "server.log")
    try:
        cmd = [
            str(guidellm),
            "run",
            "--backend",
            f"kind=openai_http,target={srv.url},model={model}",
            "--profile",
            "kind=synchronous",
            "--constraint",
            "kind=max_requests,count=8",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
            "--tokenizer",
            f"kind=huggingface_auto,model={model}",
            "--output",
            f"kind=json,path={tmp_path / 'report.json'}",
            "--disable-progress",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        srv.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["successful"] == 8 and totals["errored"] == 0, totals
