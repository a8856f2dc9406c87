"""`onegpu bench infer`: measurements per setting, interleaved repetitions, json/markdown/PNG
outputs."""

from __future__ import annotations

import json

import pytest

from onegpu.bench import infer as bench_infer
from onegpu.cli.main import main
from onegpu.errors import ConfigError


def test_settings_combine_tokens_and_reject_unknown_ones():
    settings = bench_infer.parse_settings("bf16+static-compile, nf4", "m", "cpu", "aot_eager")
    assert [s.name for s in settings] == ["hf-default", "bf16+static-compile", "nf4"]
    combo = settings[1]
    assert combo.infer.dtype == "bf16" and combo.sampling.compile == "default"
    assert combo.sampling.compile_backend == "aot_eager" and settings[2].infer.quantization == "nf4"
    with pytest.raises(ConfigError, match="unknown token 'int3'"):
        bench_infer.parse_settings("fp32,int3", "m", "cpu", "inductor")


def test_bench_measures_each_setting_interleaved(tmp_path, monkeypatch, capsys):
    calls = []
    real = bench_infer.time_generate

    def spy(model, inputs, kwargs, device):
        calls.append(id(model))
        return real(model, inputs, kwargs, device)

    monkeypatch.setattr(bench_infer, "time_generate", spy)
    argv = [
        "infer",
        "--model",
        "tiny",
        "--vocab_size",
        "512",
        "--settings",
        "fp32,ao-int8",
        "--prompt_len",
        "8",
        "--new_tokens",
        "4",
        "--batch_size",
        "2",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
        "--name",
        "r",
    ]
    assert main(["bench", *argv]) == 0

    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["setting"]: r for r in result["results"]}
    assert list(rows) == ["hf-default", "fp32", "ao-int8"]
    for row in rows.values():
        assert (
            row["prefill_tps"] > 0
            and row["decode_tps"] > 0
            and row["ttft_ms"] > 0
            and len(row["runs"]) == 2
        )
    assert rows["fp32"]["max_logit_diff"] == 0 and rows["fp32"]["token_agreement"] == 1.0
    assert rows["ao-int8"]["weight_mb"] < 0.75 * rows["fp32"]["weight_mb"]
    assert 0 < rows["ao-int8"]["max_logit_diff"] < 1.0
    # reference, warm-up x3, then the timed runs in A B C A B C order
    timed = calls[4:]
    assert len(timed) == 6 and timed[:3] == timed[3:] and len(set(timed[:3])) == 3
    assert result["device"].startswith("CPU") and result["versions"]["torch"]
    assert result["command"].startswith("onegpu bench infer --model tiny")
    md = (tmp_path / "r.md").read_text()
    assert "| ao-int8 |" in md and "decode tok/s" in md
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "| hf-default |" in capsys.readouterr().out


def test_bench_command_errors_are_clear(capsys):
    assert main(["bench", "infr"]) == 2
    assert "did you mean 'onegpu bench infer'" in capsys.readouterr().err
    assert main(["bench", "infer", "--new_tokens", "0"]) == 2
    assert "--new_tokens must be >= 1" in capsys.readouterr().err
