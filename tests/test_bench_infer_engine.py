"""`onegpu bench infer` on the decode engine: settings, presets, the bandwidth share and the memory
breakdown, end to end on a tiny model (CPU, fp32, eager)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onegpu.bench import infer_roofline as roof
from onegpu.bench import infer_settings
from onegpu.cli.main import main
from onegpu.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_engine_tokens_parse_and_mixing_paths_is_refused():
    settings = infer_settings.parse_settings(
        "engine+ao-int8+compile,engine+nf4,hf-static-compile", "m", "cpu", "inductor", "bf16"
    )
    assert [s.name for s in settings] == [
        "hf-default",
        "engine+ao-int8+compile",
        "engine+nf4",
        "hf-static-compile",
    ]
    assert all(s.infer.dtype == "bf16" for s in settings)  # the bench's dtype, baseline included
    ao, nf4, hf = settings[1:]
    assert ao.engine and ao.engine_compile == "on" and ao.infer.quantization == "ao-int8"
    assert nf4.engine and nf4.engine_compile == "off" and nf4.bnb
    assert nf4.note("cuda") == "engine, eager; memory saving, decodes slower"
    assert ao.note("cuda") == "engine, compiled (inductor, CUDA graphs)"
    assert not hf.engine and hf.sampling.compile == "default"
    with pytest.raises(ConfigError, match="compile is the engine's"):
        infer_settings.parse_settings("bf16+compile", "m", "cpu", "inductor")
    with pytest.raises(ConfigError, match="mixes the engine"):
        infer_settings.parse_settings("engine+static-compile", "m", "cpu", "inductor")


def _dry(capsys, *argv) -> tuple[str, list[str]]:
    assert main(["bench", "infer", *argv, "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    return out, [line.strip() for line in out.splitlines() if line.startswith("  ")]


def test_the_default_settings_lead_with_the_engine_eager_and_compiled(capsys):
    """A first `onegpu bench infer` measures the engine that generate, serve and GRPO decode with,
    beside transformers' generate settings, against plain generate (hf-default)."""
    _, listed = _dry(capsys)
    assert listed[:3] == ["hf-default", "engine", "engine+compile"]
    assert {"fp32", "bf16", "static-compile"} <= set(listed[3:])
    engine, compiled = infer_settings.parse_settings(",".join(listed[1:3]), "m", "cpu", "inductor")[
        1:
    ]
    assert engine.engine and engine.engine_compile == "off"
    assert compiled.engine and compiled.engine_compile == "on"


def test_presets_expand_to_the_documented_settings(capsys):
    out, listed = _dry(capsys, "--preset", "gpu")
    assert listed == ["hf-default", "engine+bf16+compile", "engine+int8", "engine+nf4"]
    assert "dry run: 1b on cuda (bf16), batch 8,1 x prompt 512, 128 new tokens, 5 rounds" in out
    out, listed = _dry(capsys, "--preset", "gpu-quant")
    assert listed == [
        "hf-default",
        "engine+bf16+compile",
        "engine+ao-int8+compile",
        "engine+ao-int4+compile",
    ]
    assert "dry run: 1b on cuda (bf16), batch 1 x prompt 512, 128 new tokens, 3 rounds" in out
    out, listed = _dry(capsys, "--preset", "cpu", "--repeats", "6")  # later flags override
    assert listed == [
        "hf-default",
        "hf-static-compile",
        "engine+fp32",
        "engine+fp32+compile",
        "engine+fp32+eager-attention+compile",
    ]
    assert "dry run: tiny on cpu (fp32), batch 1,16 x prompt 512, 128 new tokens, 6 rounds" in out
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert (
        "onegpu bench infer --preset gpu" in readme and "onegpu bench infer --preset cpu" in readme
    )
    assert main(["bench", "infer", "--preset", "tpu", "--dry_run", "true"]) == 2
    assert "unknown preset 'tpu'" in capsys.readouterr().err


def test_bandwidth_share_is_bytes_per_step_times_steps_per_second_over_bandwidth(tiny_tokenizer):
    from helpers import make_tiny_llama
    from onegpu import hardware
    from onegpu.techniques.quantization import weight_bytes

    untied = make_tiny_llama(tiny_tokenizer)  # the embedding table is read a row at a time
    embed = weight_bytes(untied.get_input_embeddings())
    assert roof.weight_read_bytes(untied) == weight_bytes(untied) - embed
    tied = make_tiny_llama(tiny_tokenizer, tie_word_embeddings=True)  # read whole, as the head
    assert roof.weight_read_bytes(tied) == weight_bytes(tied)
    assert roof.mean_context(100, 11) == 100 + 5.5  # decode steps attend 101 .. 110 positions
    step = roof.bytes_per_step(1_000_000, rows=4, positions=105.5, kv_bytes_per_position=2048)
    assert step == 1_000_000 + 4 * 105.5 * 2048
    # 2 ms a step = 500 steps/s; at 10 GB/s the limit is 10e9 / step bytes steps/s
    assert roof.bandwidth_share(step, 2.0, 10.0) == pytest.approx(step * 500 / 10e9)
    assert roof.bandwidth_share(step, None, 10.0) is None
    # a catalog card's figure is its own datasheet's, not measured here: the SXM and PCIe H100s
    # (one name apart) get their own entries' different figures
    sxm = hardware.DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0))
    pcie = hardware.DeviceInfo("cuda", "NVIDIA H100 PCIe", 80 * 2**30, (9, 0))
    figures = {}
    for device, key in ((sxm, "H100"), (pcie, "H100-PCIe")):
        entry = next(g for g in hardware.CATALOG if g.key == key)
        gbs, source = hardware.memory_bandwidth(device)
        assert (gbs, source) == (entry.bandwidth_gbs, f"GPU catalog: {entry.name} datasheet")
        figures[key] = gbs
    assert figures["H100"] != figures["H100-PCIe"]
    gbs, method = hardware.memory_bandwidth(hardware.DeviceInfo("cpu", "CPU", 2**34))
    assert gbs > 0.1 and method.startswith("torch.sum over a 256 MiB fp32 tensor")


def test_bench_runs_engine_settings_end_to_end(tmp_path, capsys):
    argv = ["bench", "infer", "--model", "tiny", "--vocab_size", "512", "--dtype", "fp32"]
    argv += ["--settings", "engine+fp32,engine+ao-int8", "--batch_size", "1,2"]
    argv += ["--prompt_len", "8", "--new_tokens", "6", "--sync_every", "2", "--repeats", "2"]
    assert main([*argv, "--out", str(tmp_path), "--name", "e"]) == 0

    result = json.loads((tmp_path / "e.json").read_text())
    assert result["rounds"] == {"1": 2, "2": 2}
    rows = {(r["setting"], r["batch_size"]): r for r in result["results"]}
    assert set(rows) == {
        (s, b) for s in ("hf-default", "engine+fp32", "engine+ao-int8") for b in (1, 2)
    }
    gbs = result["bandwidth"]["gbs"]
    assert len(result["bandwidth"]["runs"]) == 4 and gbs > 0  # measured before each round
    for (_, batch), row in rows.items():
        assert len(row["runs"]) == 2 and row["ms_per_step"] > 0
        for run in row["runs"]:  # the steps after the first token, which arrives with the prompt
            assert run["decode_steps_timed"] == 5
            assert run["decode_tps"] == pytest.approx(batch * 1000 / run["ms_per_step"])
        assert row["bytes_per_step"] == roof.bytes_per_step(
            row["weight_read_bytes"], batch, 8 + 3, row["kv_bytes_per_position"]
        )
        share = row["bytes_per_step"] * (1000 / row["ms_per_step"]) / (gbs * 1e9)
        assert row["bandwidth_share"] == pytest.approx(share)
        assert row["memory_mb"]["peak"] is None and row["load1"] >= 0
    engine = rows[("engine+fp32", 2)]
    assert engine["path"] == "engine" and engine["kv_source"] == "engine.stats().kv_bytes"
    # the engine's pool is sized to the request: 2 rows x a block of 16 for 8 + 6 positions, and
    # the null block
    assert engine["memory_mb"]["kv"] * 2**20 == 3 * 16 * engine["kv_bytes_per_position"]
    assert engine["token_agreement"] == 1.0  # greedy fp32 through the engine = HF generate's
    assert rows[("engine+ao-int8", 1)]["weight_read_bytes"] < engine["weight_read_bytes"]
    md = (tmp_path / "e.md").read_text()
    assert "## Batch 2" in md and "| engine+ao-int8 | engine, eager |" in md
    assert "% of bandwidth" in md and "not measured on a CPU" in md
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "e.partial.json").exists()
