"""Which of llama.cpp's pre-tokenizers splits text as the model's tokenizer does. llama.cpp knows a
tokenizer by a hash of the ids it gives a fixed text, so a tokenizer trained here (the default
job's byte-level BPE) is unknown to it. The name is decided from tokenizer.json's pre-tokenizer and
normalizer, never guessed, and proven afterwards by tokenizing a test set both ways (gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

# Texts whose tokens llama.cpp and `tokenizers` must agree on: code, prose, whitespace runs,
# digits, contractions, punctuation runs, non-Latin scripts and emoji (the cases where
# pre-tokenizers differ)
TEST_SET = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. I've been told he's there; we'll see.",
    "  two spaces,\tthen a tab\n\n\nand three newlines   \n",
    "3 33 333 3333 33333 3.14159 1,000,000 0x1F",
    '!!!??? ...--- ===\'\'\' """quotes"""',
    "Здравствуй, мир! 你好，世界！ こんにちは 🚀🦙 café naïve",
)


def decide(model_dir: Path) -> tuple[Optional[str], str]:
    """(llama.cpp's pre-tokenizer name, why), or (None, why not) when tokenizer.json's set-up is
    none that llama.cpp implements under a name."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None, "no tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre, norm = spec.get("pre_tokenizer"), spec.get("normalizer")
    if norm is not None:
        return None, f"a {norm.get('type')} normalizer (llama.cpp's BPE pre-tokenizers have none)"
    model = (spec.get("model") or {}).get("type")
    if model != "BPE":
        return None, f"a {model} model, not BPE"
    if (
        pre
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    ):
        return "gpt-2", "byte-level BPE with GPT-2's split regex and no prefix space"
    return None, f"pre-tokenizer {json.dumps(pre)[:200]} matches none of llama.cpp's by name"
