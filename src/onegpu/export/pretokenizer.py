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


# The split regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp) that a Split + ByteLevel
# sequence in tokenizer.json can spell: Qwen2's splits digits one by one, Llama 3's in threes
SPLIT_REGEXES = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def decide(model_dir: Path) -> tuple[Optional[str], str]:
    """(llama.cpp's pre-tokenizer name, why), or (None, why not) when tokenizer.json's set-up is
    none that llama.cpp implements under a name."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None, "no tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    model = (spec.get("model") or {}).get("type")
    if model != "BPE":
        return None, f"a {model} model, not BPE"
    name, why = _named(pre)
    if name is None:
        return None, why
    if norm is not None:
        # llama.cpp normalizes nothing: NFC text (the test set's) tokenizes the same, other text
        # may not, which is what the proof by tokenizing is for
        if norm.get("type") != "NFC" or name != "qwen2":
            return None, f"a {norm.get('type')} normalizer (llama.cpp's {name} has none)"
        why += "; tokenizer.json's NFC normalizer is not applied by llama.cpp"
    return name, why


def _named(pre: dict) -> tuple[Optional[str], str]:
    if (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    ):
        return "gpt-2", "byte-level BPE with GPT-2's split regex and no prefix space"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2:
        split, byte = steps
        regex = (split.get("pattern") or {}).get("Regex") if split.get("type") == "Split" else None
        plain_bytes = byte.get("type") == "ByteLevel" and not byte.get("use_regex", True)
        for name, want in SPLIT_REGEXES.items():
            if regex == want and plain_bytes and split.get("behavior") == "Isolated":
                return name, f"byte-level BPE split by {name}'s regex"
    return None, f"pre-tokenizer {json.dumps(pre)[:200]} matches none of llama.cpp's by name"
