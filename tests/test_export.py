"""`onegpu export --format safetensors`: the merged export loads as a Hub model and computes what
the adapter did, the check compares it with the engine's greedy tokens (and fails when they
differ), the folder is whole or absent, and each bad input gets one clear error."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch

from helpers import make_tiny_llama
from onegpu.errors import ConfigError, ModelError
from onegpu.export import ExportConfig, export
from onegpu.export.folder import PARTIAL, DiskFullError, atomic_folder

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


def _adapter(base_dir, tokenizer, out, **overrides):
    """A LoRA adapter with random (non-zero) weights on both factors, so merging changes the
    model."""
    from peft import LoraConfig, get_peft_model

    model = make_tiny_llama(tokenizer, **overrides)
    torch.manual_seed(1)
    peft = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft.save_pretrained(str(out))
    return peft.eval()


def _quiet(_text):
    pass


def test_lora_export_loads_as_plain_transformers_and_the_check_passes(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    from transformers import AutoModelForCausalLM

    peft = _adapter(tiny_model_dir, tiny_tokenizer, tmp_path / "adapter")
    out = tmp_path / "out"
    cfg = ExportConfig(
        model=str(tiny_model_dir),
        adapter=str(tmp_path / "adapter"),
        output=str(out),
        prompts=["def add(a, b):", "The quick brown"],
    )
    result = export(cfg, say=_quiet)
    folder = out / "safetensors"
    assert result.passed and result.checked
    assert not (folder / "adapter_config.json").exists()
    assert not list(tmp_path.glob(f"*{PARTIAL}*"))
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(loaded).__name__ == "LlamaForCausalLM"  # not a PeftModel
    assert not any("lora" in k for k in loaded.state_dict())
    ids = torch.tensor([tiny_tokenizer("def add(a, b):")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, peft(input_ids=ids).logits)
    report = json.loads((folder / "export-check.json").read_text())
    assert report["status"] == "passed"
    assert [r["status"] for r in report["results"]] == ["equal", "equal"]
    assert all(r["compared"] == r["equal"] == 64 for r in report["results"])


def test_the_check_fails_on_a_changed_export_and_names_the_first_divergence(
    tiny_model_dir, tiny_tokenizer
):
    from onegpu.export.check import check_greedy, make_reference
    from onegpu.export.runtimes import transformers_greedy

    ref = make_reference(str(tiny_model_dir), None, ["def add(a, b):"], 16)
    broken = make_tiny_llama(tiny_tokenizer).eval()
    with torch.no_grad():  # what a wrong merge or a lost tensor does: another function
        broken.lm_head.weight.mul_(-1)
    report = check_greedy(
        ref, lambda ids, n: transformers_greedy(broken, ids, n), "float32", "x", "transformers"
    )
    assert not report.passed
    d = report.results[0]["divergence"]
    assert report.results[0]["status"] == "diverged"
    assert d["position"] == report.results[0]["equal"] == 0
    assert d["reference_token"] == ref.tokens[0][0] != d["export_token"]
    assert d["logit_gap"] > d["tie_tolerance"]
    assert "FAILED" in report.summary and "token 0" in report.summary


def test_a_swap_within_rounding_is_a_tie_and_a_clear_gap_is_not():
    from onegpu.export.compare import compare_greedy, tie_tolerance

    src = torch.zeros(4, 8)
    src[:, 1] = 10.0
    src[2, 5] = 10.0 - 0.01  # token 5 is 0.01 below token 1: bfloat16 rounds that away at 10
    exp = src.clone()
    exp[2, 5] = 10.02
    rows = lambda i: (src[i].numpy(), exp[i].numpy())  # noqa: E731
    tie = compare_greedy("p", [1, 1, 1, 1], [1, 1, 5, 1], rows, str, "bfloat16")
    assert tie.status == "tie" and tie.equal == 2 and tie.divergence.tie
    assert tie_tolerance(src[2].numpy(), "bfloat16") > 0.01 > tie_tolerance(src[2], "float32")
    strict = compare_greedy("p", [1, 1, 1, 1], [1, 1, 5, 1], rows, str, "float32")
    assert strict.status == "diverged"
    assert strict.divergence.logit_gap == pytest.approx(0.01, abs=1e-5)
    assert compare_greedy("p", [1, 2], [1, 2], rows, str, "float32").status == "equal"


def test_refuses_to_overwrite_without_force(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cfg = ExportConfig(model=str(tiny_model_dir), output=str(out), check="off")
    with pytest.raises(ConfigError, match="already exists") as info:
        export(cfg, say=_quiet)
    assert "--force" in str(info.value) and (out / "keep.txt").is_file()
    cfg.force = True
    export(cfg, say=_quiet)
    assert not (out / "keep.txt").exists() and (out / "safetensors" / "config.json").is_file()


def test_an_interrupted_export_leaves_no_folder(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), atomic_folder(out, force=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_while_writing_is_one_clear_error(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(DiskFullError, match="filled up") as info, atomic_folder(out, False):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert "another disk" in str(info.value) and list(tmp_path.iterdir()) == []


def test_a_disk_too_small_is_refused_before_writing(tmp_path, tiny_model_dir, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    out = tmp_path / "out"
    with pytest.raises(DiskFullError, match="needs about"):
        export(ExportConfig(model=str(tiny_model_dir), output=str(out)), say=_quiet)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(ModelError, match="neither config.json nor adapter_config.json"):
        export(ExportConfig(model=str(tmp_path / "notes")), say=_quiet)


def test_an_adapter_for_another_base_is_refused_naming_both(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    _adapter(tiny_model_dir, tiny_tokenizer, tmp_path / "wide", hidden_size=96)
    cfg = ExportConfig(model=str(tiny_model_dir), adapter=str(tmp_path / "wide"), check="off")
    cfg.output = str(tmp_path / "out")
    with pytest.raises(ModelError, match="does not fit the base") as info:
        export(cfg, say=_quiet)
    assert str(tiny_model_dir) in str(info.value) and not (tmp_path / "out").exists()


def test_unknown_quant_type_and_format_are_refused_with_the_choices(tiny_model_dir):
    cfg = ExportConfig(model=str(tiny_model_dir), format="gguf", quant="q4_km")
    with pytest.raises(ConfigError, match="unknown quant type 'q4_km'") as info:
        cfg.validate()
    assert "did you mean 'q4_k_m'" in str(info.value)
    with pytest.raises(ConfigError, match="unknown export format 'onnx'"):
        ExportConfig(model="m", format="safetensors,onnx").validate()


def test_a_qlora_run_merges_into_the_full_precision_base_and_says_so(
    tmp_path, tiny_model_dir, tiny_tokenizer
):
    from onegpu.export.source import load_merged, resolve

    peft = _adapter(tiny_model_dir, tiny_tokenizer, tmp_path / "run" / "final")
    (tmp_path / "run" / "config.yaml").write_text(
        "techniques:\n  lora:\n    enabled: true\n    quantize_base: nf4\n"
    )
    src = resolve(str(tiny_model_dir), str(tmp_path / "run" / "final"), "auto")
    assert src.qlora and "full precision" in src.notes[0] and "4-bit" in src.notes[0]
    merged, _ = load_merged(src)
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft(input_ids=ids).logits)


def test_training_switches_do_not_reach_the_export(tmp_path, tiny_tokenizer):
    model = make_tiny_llama(tiny_tokenizer)
    model.config.use_cache = False  # what gradient checkpointing leaves on a run's config
    model.save_pretrained(str(tmp_path / "m"))
    tiny_tokenizer.save_pretrained(str(tmp_path / "m"))
    export(ExportConfig(model=str(tmp_path / "m"), check="off"), say=_quiet)
    config = json.loads((tmp_path / "m-export" / "safetensors" / "config.json").read_text())
    assert config["use_cache"] is True and "quantization_config" not in config


def test_cli_exports_and_a_bad_format_is_one_error(tmp_path, tiny_model_dir, capsys):
    from onegpu.cli.main import main

    out = tmp_path / "out"
    assert main(["export", str(tiny_model_dir), "--output", str(out), "--check", "off"]) == 0
    assert (out / "safetensors" / "model.safetensors").is_file()
    assert main(["export", str(tiny_model_dir), "--format", "onnx"]) == 2
    assert "unknown export format 'onnx'" in capsys.readouterr().err


def test_the_llama_cpp_build_without_a_compiler_is_one_clear_error(tmp_path):
    """scripts/build_llama_cpp.sh on a machine with no cached wheel and no cmake: it stops before
    downloading anything, naming the missing tool and the fix."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "ls", "head", "env"):  # everything but cmake and compilers
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    python = tmp_path / "python"  # a Python without llama_cpp
    python.write_text(f"#!{sys.executable} -I\nimport sys; sys.exit(1)\n")
    python.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "scripts" / "build_llama_cpp.sh"
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYTHON": str(python)}
    env["ONEGPU_LLAMA_CPP_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [str(bin_dir / "bash"), str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "needs a C/C++ compiler and cmake; 'cmake' is missing" in done.stderr
    assert "apt-get install build-essential cmake" in done.stderr
    assert not (tmp_path / "cache").exists() and os.path.isdir(tmp_path)


def test_a_sentencepiece_tokenizer_keeps_its_model_file_in_the_export(tmp_path):
    """transformers 5 saves a SentencePiece tokenizer as tokenizer.json alone; llama.cpp reads
    Gemma's, Llama 2's and Phi-3's vocabulary only from tokenizer.model, so the export (and a
    training run's folders, through the same models.save_tokenizer) copies it along."""
    from families import tiny_family_model
    from helpers import CORPUS
    from llama_support import save, sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer(tmp_path / "m", "gemma", CORPUS)
    src = save(tiny_family_model("gemma", tokenizer), tokenizer, tmp_path / "m")
    cfg = ExportConfig(model=str(src), output=str(tmp_path / "out"), format="safetensors")
    cfg.check = "off"
    export(cfg, say=lambda _text: None)
    kept = tmp_path / "out" / "safetensors" / "tokenizer.model"
    assert kept.read_bytes() == (src / "tokenizer.model").read_bytes()


def test_a_base_stored_quantized_is_refused_before_loading(tmp_path, tiny_model_dir):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    cfg = ExportConfig(model=str(base), output=str(tmp_path / "out"), check="off")
    with pytest.raises(ModelError, match="stored quantized .bitsandbytes.") as info:
        export(cfg, say=_quiet)
    assert "full-precision base" in info.value.hint and not (tmp_path / "out").exists()


def test_a_gguf_export_without_llama_cpp_python_is_one_error_before_writing(
    tmp_path, tiny_model_dir
):
    """The CLI in a Python where llama_cpp cannot be imported: exit 2, the error names the
    package and the build script, and no output folder is left."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src"
    out = tmp_path / "out"
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"  # what an environment without it gives
        "from onegpu.cli.main import main\n"
        f"sys.exit(main(['export', {str(tiny_model_dir)!r}, '--format', 'gguf', "
        f"'--output', {str(out)!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--format gguf needs llama-cpp-python" in done.stderr
    assert "scripts/build_llama_cpp.sh" in done.stderr and not out.exists()
