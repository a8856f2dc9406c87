"""What an export needs, said before it starts and by `onegpu plan`: the same figures from both,
a memory figure that bounds what the merge and the check really hold, and a disk figure per
format."""

from __future__ import annotations

import re

import pytest

from helpers import make_tiny_llama, peak_cpu_bytes
from onegpu.export import ExportConfig, export
from onegpu.export.plan import make_plan

pytestmark = pytest.mark.usefixtures("one_thread")
OVERHEAD = 256 * 2**20  # the plan's allowance for the interpreter, libraries and activations


def _model(tmp_path, tokenizer, **shape):
    path = tmp_path / "m"
    make_tiny_llama(tokenizer, **shape).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _needs(line: str) -> str:
    return re.search(r"needs (about .*? of disk \(.*?\))", line).group(1)


def test_plan_prints_the_exports_own_preflight_figures(tmp_path, tiny_tokenizer, capsys):
    from onegpu.cli.main import main

    src = _model(tmp_path, tiny_tokenizer)
    said = []
    cfg = ExportConfig(model=str(src), output=str(tmp_path / "out"), check="off")
    export(cfg, say=said.append)
    preflight = next(s for s in said if s.startswith("export plan:"))
    assert main(["plan", str(src), "--gpu", "T4", "--export", "safetensors"]) == 0
    line = next(
        s for s in capsys.readouterr().out.splitlines() if s.startswith("export (onegpu export")
    )
    assert line.startswith("export (onegpu export --format safetensors): needs about")
    assert _needs(line) == _needs(preflight)
    assert "the base in float32" in line and "safetensors " in line


def test_plan_json_gives_the_gguf_disk_and_none_leaves_the_line_out(
    tmp_path, tiny_tokenizer, capsys
):
    import json

    from onegpu.cli.main import main

    src = _model(tmp_path, tiny_tokenizer)
    base = ["plan", str(src), "--gpu", "T4"]
    assert main([*base, "--export", "gguf", "--export_quant", "q4_k_m", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    need, params = data["export"], data["params"]
    # the merged folder the converter reads (float32), its f16 GGUF, then the q4_k_m file
    assert need["disk_parts"] == {"gguf q4_k_m": params * 4 + params * 2 + int(params * 4.5 / 8)}
    assert need["quant"] == "q4_k_m" and need["dtype"] == "float32"
    assert main([*base, "--export", "none"]) == 0
    assert "export (onegpu export" not in capsys.readouterr().out
    assert main([*base, "--export", "onnx"]) == 2
    assert "unknown export format 'onnx'" in capsys.readouterr().err


def test_the_memory_figure_bounds_what_the_merge_and_the_check_hold(tmp_path, tiny_tokenizer):
    """torch's allocator peak over a whole export with its check (a LoRA merged: the float32 base,
    its cast, the float32 source beside the transformers copy) stays within the plan's per-weight
    figure (4 + 4 bytes a weight here) within 5% either way: activations and the engine's cache are
    what the fixed allowance is for, and the figure is not padding."""
    src = _model(
        tmp_path, tiny_tokenizer, hidden_size=256, intermediate_size=688, num_hidden_layers=4
    )
    from onegpu.export.plan import count_params

    params = count_params(str(src))
    plan = make_plan(params, "float32", ["safetensors"], "q8_0")
    cfg = ExportConfig(model=str(src), output=str(tmp_path / "out"), check_tokens=8)
    cfg.prompts = ["def add(a, b):"]
    peak = peak_cpu_bytes(lambda: export(cfg, say=lambda s: None))
    per_weight = plan.memory_bytes - OVERHEAD
    assert per_weight == params * 8
    assert 0.95 * per_weight <= peak <= 1.05 * per_weight, (peak, params)


def test_an_export_that_would_not_fit_in_memory_is_refused_with_both_figures():
    from onegpu.export.plan import MemoryShortError, check_memory

    plan = make_plan(10**9, "bfloat16", ["safetensors", "gguf"], "q8_0")
    check_memory(plan, plan.memory_bytes)  # exactly enough
    with pytest.raises(MemoryShortError) as info:
        check_memory(plan, plan.memory_bytes - 2**20)
    need, free = plan.memory_bytes / 2**20, plan.memory_bytes / 2**20 - 1
    assert f"needs about {need:,.0f} MiB of memory" in str(info.value)
    assert f"and {free:,.0f} MiB is free" in str(info.value) and need > 4 * 10**9 / 2**20
    assert "more memory" in info.value.hint
