"""The locally trained tokenizer (data/tokenizer.py): its digit option, and that it survives a save
and reload."""

from __future__ import annotations

import pytest

from onegpu.data.tokenizer import train_tokenizer

# numbers of several lengths, often enough for BPE to merge their digits when it may
CORPUS = [f"{a}+{b}={a + b} and {a * 7}" for a in range(10, 400, 3) for b in (12, 345, 6789)] * 3


def _digit_tokens(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def test_split_digits_gives_each_digit_its_own_token_and_without_it_they_merge():
    merged = train_tokenizer(CORPUS, 512, "test-digits")
    split = train_tokenizer(CORPUS, 512, "test-digits", split_digits=True)
    assert _digit_tokens(split, "12345") == ["1", "2", "3", "4", "5"]
    assert len(_digit_tokens(merged, "12345")) < 5
    # the two are cached under different keys: asking again returns each its own kind
    assert len(_digit_tokens(train_tokenizer(CORPUS, 512, "test-digits"), "12345")) < 5
    again = train_tokenizer(CORPUS, 512, "test-digits", split_digits=True)
    assert _digit_tokens(again, "12345") == ["1", "2", "3", "4", "5"]


def test_a_digit_split_tokenizer_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(CORPUS, 512, "test-digits-save", split_digits=True)
    tok.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "123+4567 is 4690, not 46 90"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert _digit_tokens(loaded, "4690") == ["4", "6", "9", "0"]
    assert loaded.decode(ids) == text  # the digits come back joined, with no spaces put in
    chat = [{"role": "user", "content": "98-53"}, {"role": "assistant", "content": "45"}]
    rendered = loaded.apply_chat_template(chat, tokenize=False)
    assert loaded.decode(loaded(rendered, add_special_tokens=False)["input_ids"]) == rendered


def test_split_digits_on_a_tokenizer_not_trained_here_is_refused(tmp_path):
    from onegpu.config import Config
    from onegpu.errors import ConfigError
    from onegpu.training.data import build_tokenizer

    cfg = Config()
    cfg.model.split_digits = True
    cfg.model.tokenizer = str(tmp_path)
    with pytest.raises(ConfigError, match="model.split_digits applies only"):
        build_tokenizer(cfg, "tiny", [], "text", "x")
    cfg.model.tokenizer = None
    with pytest.raises(ConfigError, match="model.split_digits applies only"):
        build_tokenizer(cfg, str(tmp_path), [], "text", "x")
