"""`onegpu export --format gguf|ollama` for real: llama.cpp's converter and quantizer write the
GGUF and llama.cpp (llama-cpp-python, scripts/build_llama_cpp.sh) loads it and passes the check
against onegpu's engine. Slow: `make test-all` builds or reuses the binding first; without it
these fail with the command that builds it (they never skip in the whole suite)."""

from __future__ import annotations

import json

import pytest

from families import FAMILIES, tiny_family_model
from helpers import make_tiny_llama
from llama_support import llama_cpp_ready, save  # noqa: F401 (a fixture)
from onegpu.errors import ConfigError
from onegpu.export import ExportConfig, export

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "llama_cpp_ready")]
PROMPTS = ["def add(a, b):", "The quick brown"]


def _quiet(_text):
    pass


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_the_default_jobs_model_exports_and_passes_in_llama_cpp(tmp_path, tiny_tokenizer, quant):
    from onegpu.models import PRESETS

    shape = {k: v for k, v in PRESETS["tiny"].items()}  # `onegpu train`'s model on a CPU
    src = save(make_tiny_llama(tiny_tokenizer, **shape), tiny_tokenizer, tmp_path / "m")
    out = tmp_path / "out"
    cfg = ExportConfig(model=str(src), output=str(out), format="gguf,ollama", quant=quant)
    cfg.prompts = PROMPTS
    result = export(cfg, say=_quiet)
    assert result.passed, result.summaries
    report = json.loads((out / "gguf" / "export-check.json").read_text())
    assert report["status"] == "passed"
    tok = report["metrics"]["tokenizer"]
    assert tok["mismatches"] == [] and tok["identical"] == tok["texts"] >= 8
    meta = report["metrics"]["gguf"]
    assert meta["tokenizer.ggml.pre"] == "gpt-2"  # decided from tokenizer.json, then proven
    assert meta["tokenizer.ggml.add_bos_token"] == "false"
    assert meta["tokenizer.chat_template"] == tiny_tokenizer.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == str(tiny_tokenizer.eos_token_id)
    if quant == "f16":
        assert all(r["status"] == "equal" and r["compared"] == 64 for r in report["results"])
    else:
        assert (
            report["metrics"]["top1_agreement"]
            >= report["metrics"]["thresholds"]["top1_agreement_min"]
        )
    assert (out / "ollama" / f"model-{quant}.gguf").is_file()
    assert 'PARAMETER stop "<|eos|>"' in (out / "ollama" / "Modelfile").read_text()


# Refused before anything is written, with the reason the error gives (each checked below): the
# converter reads these vocabularies only from a SentencePiece tokenizer.model (a tokenizer onegpu
# trains has none), takes a family's own special tokens, or computes a setting one way only.
REFUSED = {
    "gemma": "reads the vocabulary only from a SentencePiece tokenizer.model",
    "gemma2": "reads the vocabulary only from a SentencePiece tokenizer.model",
    "phi3": "reads the vocabulary only from a SentencePiece tokenizer.model",
    "glm4": "takes the special token '<|endoftext|>' from the family's own tokenizer",
    "qwen3_moe": "computes norm_topk_prob=true only",
    "phi": "architecture has as many K/V heads as heads",  # the zoo's phi has 2 K/V heads of 4
}
# Exported and checked, and the check fails (the export exits 1, marked unchecked): none open
# (deepseek_v3 was one until the converter was told its router's sigmoid: convert_driver.py)
FAILS: dict[str, str] = {}


@pytest.mark.parametrize(
    "family, overrides",
    [
        pytest.param(
            f, {}, marks=[pytest.mark.xfail(strict=True, reason=FAILS[f])] if f in FAILS else []
        )
        for f in FAMILIES
    ]
    + [("qwen3_moe", {"norm_topk_prob": True})],
    ids=[*FAMILIES, "qwen3_moe-norm_topk_prob"],
)
def test_each_zoo_family_exports_f16_and_passes_or_is_refused_up_front(
    tmp_path, tiny_tokenizer, family, overrides
):
    """Every family of the test zoo: the f16 GGUF's greedy tokens equal the engine's, or one
    error names the family and the reason before anything is written."""
    model = tiny_family_model(family, tiny_tokenizer, **overrides)
    src = save(model, tiny_tokenizer, tmp_path / "m")
    cfg = ExportConfig(model=str(src), output=str(tmp_path / "out"), format="gguf", quant="f16")
    cfg.prompts = PROMPTS[:1]
    if family in REFUSED and not overrides:
        said: list[str] = []
        with pytest.raises(ConfigError) as info:
            export(cfg, say=said.append)
        assert str(info.value).startswith(f"family {family} ")
        assert REFUSED[family] in str(info.value) and not (tmp_path / "out").exists()
        assert not any(line.startswith("merging") for line in said)  # refused before the merge
        return
    result = export(cfg, say=_quiet)
    assert result.passed, result.summaries


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_lora_adapter_of_two_families_exports_merged_to_q8_0(tmp_path, tiny_tokenizer, family):
    import torch
    from peft import LoraConfig, get_peft_model

    base = tiny_family_model(family, tiny_tokenizer)
    src = save(base, tiny_tokenizer, tmp_path / "base")
    torch.manual_seed(1)
    peft = get_peft_model(
        tiny_family_model(family, tiny_tokenizer),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft.save_pretrained(str(tmp_path / "adapter"))
    cfg = ExportConfig(model=str(src), adapter=str(tmp_path / "adapter"), format="gguf")
    cfg.output, cfg.quant, cfg.prompts = str(tmp_path / "out"), "q8_0", PROMPTS
    result = export(cfg, say=_quiet)
    assert result.passed, result.summaries


def test_a_wrong_pre_tokenizer_is_reported_as_a_mismatch(tmp_path, tiny_tokenizer):
    from onegpu.export.check import make_reference
    from onegpu.export.gguf import Converter, TokenizerFacts, convert
    from onegpu.export.gguf_check import check_gguf
    from onegpu.export.llama_setup import converter_dir

    src = save(make_tiny_llama(tiny_tokenizer), tiny_tokenizer, tmp_path / "m")
    wrong = TokenizerFacts("llama-bpe", "forced wrong", False, [tiny_tokenizer.eos_token_id])
    with Converter(converter_dir()) as converter:
        gguf = convert(src, tmp_path / "g", "f16", wrong, converter, say=_quiet)
    report = check_gguf(make_reference(str(src), None, PROMPTS[:1], 8), gguf, "f16")
    mismatches = report.metrics["tokenizer"]["mismatches"]
    assert not report.passed and mismatches and "TOKENIZER MISMATCH" in report.summary
    assert mismatches[0]["tokenizers"] != mismatches[0]["llama.cpp"]


def test_a_family_the_converter_lacks_is_refused_up_front(tmp_path, tiny_tokenizer):
    src = save(make_tiny_llama(tiny_tokenizer), tiny_tokenizer, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    cfg = ExportConfig(model=str(src), output=str(tmp_path / "out"), format="gguf")
    with pytest.raises(ConfigError, match="family llama .NoSuchModelForCausalLM. cannot be"):
        export(cfg, say=_quiet)
    assert not (tmp_path / "out").exists()


def test_one_converter_process_reads_the_vocabulary_then_converts(tmp_path, tiny_tokenizer):
    """The vocabulary step before the merge and the conversion after it are two requests to one
    start of llama.cpp's converter (convert_driver.py): both answers come from its one process,
    and the GGUF it writes is whole."""
    from onegpu.export.gguf import Converter, tokenizer_facts
    from onegpu.export.llama_setup import converter_dir

    model = make_tiny_llama(tiny_tokenizer)
    src = save(model, tiny_tokenizer, tmp_path / "m")
    facts = tokenizer_facts(src, tiny_tokenizer)
    with Converter(converter_dir()) as converter:
        vocab = converter.request(src, tmp_path / "vocab.gguf", "vocab", facts)
        full = converter.request(src, tmp_path / "model.gguf", "f16", facts)
    assert vocab["rc"] == full["rc"] == 0
    assert vocab["pid"] == full["pid"] == converter.pid
    weights = 2 * sum(p.numel() for p in model.parameters())  # f16: 2 bytes each at least
    assert (
        (tmp_path / "vocab.gguf").stat().st_size
        < weights
        <= (tmp_path / "model.gguf").stat().st_size
    )


def test_a_converter_that_dies_is_one_error_naming_the_signal(tmp_path, tiny_tokenizer):
    import os
    import signal

    from onegpu.export.gguf import ConversionError, Converter, convert, tokenizer_facts
    from onegpu.export.llama_setup import converter_dir

    src = save(make_tiny_llama(tiny_tokenizer), tiny_tokenizer, tmp_path / "m")
    facts = tokenizer_facts(src, tiny_tokenizer)
    with Converter(converter_dir()) as converter:
        os.kill(converter.pid, signal.SIGKILL)
        with pytest.raises(ConversionError, match="killed by signal 9"):
            convert(src, tmp_path / "g", "f16", facts, converter, say=_quiet)


def test_a_disk_that_fills_during_the_conversion_is_the_disk_full_error(tmp_path, tiny_tokenizer):
    """The converter writes its GGUF in its own process; a full disk there (the GGUF's path
    leads to /dev/full, where every write fails with ENOSPC) is still the export's one disk-full
    error, and the partial folder is removed."""
    from onegpu.export.folder import DiskFullError, atomic_folder
    from onegpu.export.gguf import Converter, convert, tokenizer_facts
    from onegpu.export.llama_setup import converter_dir

    src = save(make_tiny_llama(tiny_tokenizer), tiny_tokenizer, tmp_path / "m")
    facts = tokenizer_facts(src, tiny_tokenizer)
    out = tmp_path / "out"
    with Converter(converter_dir()) as converter:
        with (
            pytest.raises(DiskFullError, match="filled up while writing"),
            atomic_folder(out, False) as tmp,
        ):
            (tmp / "gguf").mkdir()
            (tmp / "gguf" / "model-f16.gguf").symlink_to("/dev/full")
            convert(src, tmp / "gguf", "f16", facts, converter, say=_quiet)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m"]
