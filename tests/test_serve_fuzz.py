"""The published API, fuzzed: schemathesis generates requests from /openapi.json against a live
`onegpu serve` (the tiny model, 127.0.0.1) and checks every answer: no 5xx, only documented status
codes and content types, and every body valid against the published response schema. A bounded
example count per operation; the slow tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_support import Server

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)


def test_the_openapi_spec_is_published_without_metrics(tiny_model_dir, tmp_path):
    """Fast: the spec validates as OpenAPI (schemathesis loads it) and leaves /metrics out."""
    pytest.importorskip("schemathesis")
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from onegpu.serve.app import build_app
    from serve_fakes import make_service

    service, _ = make_service(AutoTokenizer.from_pretrained(str(tiny_model_dir)), lambda p, s: "x")
    spec = TestClient(build_app(service)).get("/openapi.json").json()
    assert "/metrics" not in spec["paths"] and "/v1/completions" in spec["paths"]
    import schemathesis

    loaded = schemathesis.openapi.from_dict(spec)
    assert {op.ok().path for op in loaded.get_all_operations()} >= {
        "/v1/chat/completions",
        "/health",
    }


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_answer_outside_the_schema(tiny_model_dir, tmp_path):
    pytest.importorskip("schemathesis")
    args = ["--model", str(tiny_model_dir), "--served_name", "tiny", "--max_len", "128"]
    srv = Server(args, tmp_path / "server.log")
    try:
        cmd = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{srv.url}/openapi.json",
            "--checks",
            CHECKS,
            "--max-examples",
            "25",
            "--seed",
            "1",
            "--request-timeout",
            "60",
            "--generation-database",
            "none",
            "--no-color",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200  # still serving
    finally:
        srv.stop()
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
