"""The families whose llama.cpp converter reads the vocabulary only from a SentencePiece
``tokenizer.model`` (Gemma, Gemma 2, Phi-3; Mistral's and Llama 2's tokenizers are SentencePiece
too) export and pass the check when they carry one, as their Hub checkpoints do. The test zoo's
byte-level BPE has no such file, so with it these families are refused up front
(tests/test_export_gguf.py); here each gets a SentencePiece model trained on the test corpus, and
the check proves llama.cpp tokenizes it as transformers does and decodes the same tokens. Slow:
llama.cpp's binding (scripts/build_llama_cpp.sh)."""

from __future__ import annotations

import json

import pytest

from families import tiny_family_model
from helpers import CORPUS
from llama_support import llama_cpp_ready, save, sentencepiece_tokenizer  # noqa: F401 (a fixture)
from onegpu.export import ExportConfig, export

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "llama_cpp_ready")]
PROMPTS = ["def add(a, b):", "The quick brown"]
STYLE = {"gemma": "gemma", "gemma2": "gemma", "phi3": "llama", "mistral": "llama"}
# transformers 5 builds a Llama-style SentencePiece tokenizer (Metaspace, prepend "first") that
# gives one "▁" fewer than SentencePiece itself for a text opening with two spaces; llama.cpp
# tokenizes as SentencePiece does. The check reports it, as it must: a mismatch is never hidden
DOUBLE_SPACE = "  two spaces,\tthen a tab"


@pytest.mark.parametrize("family", list(STYLE))
def test_a_sentencepiece_family_exports_f16_and_its_check_compares_tokenizers(tmp_path, family):
    tokenizer = sentencepiece_tokenizer(tmp_path / "m", STYLE[family], CORPUS)
    src = save(tiny_family_model(family, tokenizer), tokenizer, tmp_path / "m")
    assert (src / "tokenizer.model").is_file()
    out = tmp_path / "out"
    cfg = ExportConfig(model=str(src), output=str(out), format="gguf", quant="f16")
    cfg.prompts = PROMPTS
    result = export(cfg, say=lambda _text: None)
    report = json.loads((out / "gguf" / "export-check.json").read_text())
    assert report["metrics"]["gguf"]["tokenizer.ggml.model"] == "llama"  # SentencePiece's
    assert all(r["status"] == "equal" and r["compared"] == 64 for r in report["results"])
    tok = report["metrics"]["tokenizer"]
    if STYLE[family] == "gemma":
        assert result.passed, result.summaries
        assert tok["mismatches"] == [] and tok["identical"] == tok["texts"] >= 8
    else:
        assert not result.passed and "TOKENIZER MISMATCH on 1/8" in result.summaries[0]
        assert [m["text"].startswith(DOUBLE_SPACE) for m in tok["mismatches"]] == [True]
