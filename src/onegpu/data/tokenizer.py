"""A byte-level BPE tokenizer trained locally (no download) for models trained from scratch."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterable

from onegpu.paths import cache_dir

log = logging.getLogger(__name__)

SPECIAL = {
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
    "pad_token": "<|pad|>",
    "unk_token": "<|unk|>",
}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Assistant turns end with EOS so a chat model learns to stop.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, fingerprint: str, split_digits: bool = False
):
    """Train (or load from cache) a byte-level BPE; returns a transformers PreTrainedTokenizerFast.

    ``fingerprint`` identifies the corpus; the cache key adds the vocab size and our settings.
    ``split_digits``: every digit its own token (as Llama's and GPT-4's tokenizers do), so a number
    is a string of ten common tokens a small model can copy digit by digit, not one rare token.
    """
    from transformers import PreTrainedTokenizerFast

    # The digit setting joins the key only when on, so tokenizers cached before it existed (all of
    # them without it) stay valid under their old keys.
    settings = f"{fingerprint}|{vocab_size}|{CHAT_TEMPLATE}|v1" + (
        "|digits" if split_digits else ""
    )
    key = hashlib.sha256(settings.encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / key
    if (path / "tokenizer.json").is_file():
        log.info("using cached tokenizer %s", path)
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        # Digits split first; ByteLevel then maps the pieces to bytes (and its regex leaves a
        # lone digit whole), so no merge can join two digits.
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()) + ROLE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, **SPECIAL, additional_special_tokens=ROLE_TOKENS
    )
    fast.chat_template = CHAT_TEMPLATE
    # Write to a temporary folder and rename, so a crash never leaves a half-written cache entry.
    tmp = path.with_name(f"{key}.tmp{os.getpid()}")
    fast.save_pretrained(str(tmp))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(path))
