"""`onegpu serve`'s warm-up: the decode step of every shape compiled before the server listens,
kept in --compile_cache for the next start; /metrics counts what compiles after it."""

from __future__ import annotations

import httpx
import pytest

from families import tiny_family_model
from onegpu.infer.engine import WARM_KINDS, Engine, EngineConfig
from onegpu.infer.requests import EngineStats
from onegpu.serve.config import ServeConfig
from onegpu.serve.launch import warm_up
from onegpu.serve.metrics import Metrics
from serve_support import Server

COMPILED = dict(max_slots=2, max_len=64, compile="on", compile_backend="aot_eager")


def test_the_server_warms_every_shape_when_the_step_compiles(tiny_tokenizer, capsys):
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    eager = Engine(model, None, EngineConfig(max_slots=1, max_len=64))
    warm_up(eager, ServeConfig())  # auto: nothing compiles, nothing to warm
    assert "warm-up" not in capsys.readouterr().err

    off = Engine(model, None, EngineConfig(**COMPILED))
    warm_up(off, ServeConfig(warmup="off"))
    assert not off.stats().compiled_shapes

    engine = Engine(model, None, EngineConfig(**COMPILED))
    warm_up(engine, ServeConfig())
    shapes = engine.buckets()
    assert engine.stats().compiled_shapes == {(r, k, n) for r, k in shapes for n in WARM_KINDS}
    err = capsys.readouterr().err
    assert f"compiling the decode step for {len(shapes)} shapes" in err
    assert f"warm-up: {len(shapes) * len(WARM_KINDS)} steps compiled" in err


def test_metrics_count_the_compiles_after_the_warm_up_once_each():
    metrics = Metrics()
    for compiles, seconds in ((0, 0.0), (2, 3.5), (2, 3.5), (3, 4.0)):
        metrics.engine_stats(EngineStats(0, 0, 0, 16, compiles=compiles, compile_s=seconds))
    text = metrics.render().decode()
    assert "onegpu_decode_compiles_total 3.0" in text
    assert "onegpu_decode_compile_seconds_total 4.0" in text


def test_metrics_count_the_prompt_positions_computed_and_the_decode_steps():
    metrics = Metrics()
    for computed, steps in ((0, 0), (51, 7), (54, 19)):
        metrics.engine_stats(EngineStats(0, 0, 0, 16, prefill_tokens=computed, decode_steps=steps))
    text = metrics.render().decode()
    assert "onegpu_prompt_tokens_computed_total 54.0" in text
    assert "onegpu_decode_steps_total 19.0" in text


def _complete(server: Server, **body) -> dict:
    body = {"prompt": "the cat", "max_tokens": 6, "ignore_eos": True, **body}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow  # two starts, each compiling the step with inductor: about a minute in all
def test_a_warm_server_compiles_nothing_for_plain_requests_and_starts_again_from_its_cache(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the flag's folder, not the env's
    cache = tmp_path / "compile-cache"
    args = ["--model", str(tiny_model_dir), "--compile", "on", "--max_slots", "1"]
    args += ["--max_len", "64", "--compile_cache", str(cache)]
    first = Server(args, tmp_path / "first.log")
    try:
        assert f"compile cache: {cache}" in first.text()
        assert "warm-up: 2 steps compiled" in first.text()
        assert "0 from the cache, 2 built" in first.text()
        _complete(first, temperature=0)
        _complete(first, temperature=1.0, seed=3)
        assert first.metric("onegpu_decode_compiles_total") == 0
        _complete(first, temperature=0, logprobs=2)  # a kind the warm-up left out: it compiles
        assert first.metric("onegpu_decode_compiles_total") == 1
        assert first.metric("onegpu_decode_compile_seconds_total") > 0
    finally:
        first.stop()
    assert any((cache / "fxgraph").rglob("*"))  # inductor's graphs, kept in the flag's folder
    second = Server(args, tmp_path / "second.log")
    try:
        assert "2 from the cache, 0 built" in second.text()
        _complete(second, temperature=0)
        assert second.metric("onegpu_decode_compiles_total") == 0
    finally:
        second.stop()
