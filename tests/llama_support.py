"""What the llama.cpp export tests share: the binding installed and the converter where the build
script left it (tests/conftest.py gives each session a fresh ONEGPU_CACHE, which has neither)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def llama_cpp_ready():
    from onegpu.export.llama_setup import VERSION, require_binding

    require_binding()  # one error naming scripts/build_llama_cpp.sh when absent
    root = os.environ.get("ONEGPU_LLAMA_CPP_DIR") or f"~/.cache/onegpu/llama-cpp/{VERSION}"
    old = os.environ.get("ONEGPU_LLAMA_CPP_DIR")
    os.environ["ONEGPU_LLAMA_CPP_DIR"] = str(Path(root).expanduser())
    yield
    if old is None:
        os.environ.pop("ONEGPU_LLAMA_CPP_DIR")


def save(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


# The special pieces of the two SentencePiece conventions: Gemma's (pad 0, eos 1, bos 2, unk 3) and
# Llama's, which Phi-3 keeps (unk 0, bos 1, eos 2)
SENTENCEPIECE_STYLES = {
    "gemma": dict(
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", add_dummy_prefix=False,
        tokenizer_class="GemmaTokenizer",
    ),
    "llama": dict(
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>",
        eos_piece="</s>", tokenizer_class="LlamaTokenizer",
    ),
}  # fmt: skip


def sentencepiece_tokenizer(path: Path, style: str, texts: list[str], vocab_size: int = 384):
    """A SentencePiece BPE model trained here on ``texts`` (byte fallback, so any text encodes),
    saved as ``tokenizer.model`` the way a Hub checkpoint of the family ships it, and the
    transformers tokenizer converted from it: the tokenizer a real Gemma or Phi-3 has, which the
    zoo's byte-level BPE is not."""
    import json

    import sentencepiece as spm
    from transformers import AutoTokenizer

    settings = dict(SENTENCEPIECE_STYLES[style])
    tokenizer_class = settings.pop("tokenizer_class")
    path.mkdir(parents=True, exist_ok=True)
    corpus = path / "corpus.txt"
    corpus.write_text("".join(texts * 8), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(path / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,  # a small corpus may give fewer pieces
        minloglevel=2,
        **settings,
    )
    corpus.unlink()
    (path / "tokenizer.vocab").unlink()
    config = {"tokenizer_class": tokenizer_class, "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return AutoTokenizer.from_pretrained(str(path))
