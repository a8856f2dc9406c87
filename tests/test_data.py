"""Data shapes, masking, packing, the stdlib corpus, and the batch order."""

import json

import pytest

from onegpu.config import DataConfig
from onegpu.data import batches
from onegpu.data import records as data
from onegpu.errors import DataError


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_stdlib_source_is_deterministic_and_split_by_file():
    a = data.stdlib_source(max_bytes=400_000, val_fraction=0.1)
    b = data.stdlib_source(max_bytes=400_000, val_fraction=0.1)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert a.val_files and not set(a.train_files) & set(a.val_files)
    assert all(f.endswith(".py") for f in a.train_files)


def test_text_is_packed_with_eos_between_documents(tiny_tokenizer, tmp_path):
    """The blocks are the documents' tokens end to end, each document followed by its EOS, cut
    into seq_len blocks (only the last, partial block is left out); every token is a target; the
    position ids count from 0 within each document, across block boundaries (for padding-free
    attention)."""
    import datasets

    cfg = DataConfig(seq_len=16, num_proc=1)
    docs = ["def f(x):\n    return x\n", "import os\n"] * 10
    ds = datasets.Dataset.from_dict({"text": docs})
    out = batches.tokenize_counted(ds, "text", tiny_tokenizer, cfg)[0]
    assert len(out) > 0 and all(len(r) == 16 for r in out["input_ids"])
    stream, positions = [], []
    for doc in docs:
        ids = tiny_tokenizer(doc, add_special_tokens=False)["input_ids"]
        stream += ids + [tiny_tokenizer.eos_token_id]
        positions += range(len(ids) + 1)
    kept = len(stream) // 16 * 16
    assert sum(out["input_ids"], []) == stream[:kept] and len(out) == kept // 16
    assert out["labels"] == out["input_ids"]  # EOS is trained on, never masked
    assert sum(out["position_ids"], []) == positions[:kept]


def test_prompt_completion_masks_prompt_and_ends_with_eos(tiny_tokenizer):
    import datasets

    cfg = DataConfig(seq_len=64, num_proc=1)
    ds = datasets.Dataset.from_dict({"prompt": ["Q: add 1 and 2\nA:"], "completion": [" 3"]})
    ex = batches.tokenize_counted(ds, "prompt_completion", tiny_tokenizer, cfg)[0][0]
    n_prompt = len(tiny_tokenizer("Q: add 1 and 2\nA:")["input_ids"])
    assert ex["labels"][:n_prompt] == [-100] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:]
    assert ex["input_ids"][-1] == tiny_tokenizer.eos_token_id


def test_messages_train_only_on_assistant_tokens(tiny_tokenizer):
    import datasets

    cfg = DataConfig(seq_len=128, num_proc=1)
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    ds = datasets.Dataset.from_dict({"messages": [conv]})
    ex = batches.tokenize_counted(ds, "messages", tiny_tokenizer, cfg)[0][0]
    trained = tiny_tokenizer.decode(
        [t for t, lab in zip(ex["input_ids"], ex["labels"], strict=True) if lab != -100]
    )
    assert "hi there" in trained and "see you" in trained
    assert "hello" not in trained and "bye" not in trained
    assert tiny_tokenizer.eos_token in trained  # the model learns to stop


def test_collator_masks_padding_by_position(tiny_tokenizer):
    collate = batches.Collator(tiny_tokenizer.pad_token_id, multiple=8)
    eos = tiny_tokenizer.eos_token_id
    b = collate(
        [
            {"input_ids": [5, 6, eos], "labels": [5, 6, eos]},
            {"input_ids": [7] * 9, "labels": [7] * 9},
        ]
    )
    assert b["input_ids"].shape == (2, 16)  # padded to a multiple of 8
    assert b["labels"][0, :3].tolist() == [5, 6, eos] and (b["labels"][0, 3:] == -100).all()
    assert b["attention_mask"][0].sum() == 3
    assert tiny_tokenizer.pad_token_id != eos


def test_batch_order_is_seeded_and_resumable():
    full = batches.BatchOrder(10, 3, seed=1)
    it = iter(full)
    first = [next(it) for _ in range(7)]  # crosses an epoch boundary (3 batches per epoch)
    resumed = iter(batches.BatchOrder(10, 3, seed=1, start=4))
    assert [next(resumed) for _ in range(3)] == first[4:]
    assert first[0] != first[3]  # reshuffled per epoch


def test_malformed_jsonl_line_reports_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.jsonl:3: malformed JSON"):
        data.file_source(str(p), 0.0)


def test_format_detection_and_wrong_columns(tmp_path):
    cfg = DataConfig()
    assert data.detect_format(cfg, ["prompt", "completion"]) == "prompt_completion"
    assert data.detect_format(cfg, ["messages"]) == "messages"
    with pytest.raises(DataError, match="cannot tell the data format"):
        data.detect_format(cfg, ["question", "answer"])
    with pytest.raises(DataError, match="data.prompt_field"):
        data.detect_format(DataConfig(format="prompt_completion"), ["question", "answer"])


def test_load_records_from_jsonl_folder(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": f"line {i}"} for i in range(20)])
    _jsonl(tmp_path / "b.jsonl", [{"text": f"other {i}"} for i in range(20)])
    train, val, _ = data.load_records(DataConfig(path=str(tmp_path), val_fraction=0.5), seed=0)
    assert len(train) == 20 and len(val) == 20  # held out by file


def test_hub_names_and_missing_paths(tmp_path, monkeypatch):
    for name in ("HuggingFaceH4/ultrachat_200k", "org/data.v2"):
        assert data.looks_like_hub_name(name), name
    for name in (
        "data/train.jsonl",
        "runs/data/x",
        "./org/name",
        "~/org",
        "/org/name",
        "org/train.parquet",
        "data.csv",
    ):
        assert not data.looks_like_hub_name(name), name
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        DataError,
        match=rf"data.path 'data/train.jsonl' does not exist \(looked for "
        rf"{tmp_path}/data/train.jsonl: relative paths are read from {tmp_path}\)",
    ):
        data.file_source("data/train.jsonl", 0.0)
    assert data.file_source("org/name", 0.0).hub_name == "org/name"


def test_chat_errors_name_the_record_outside_jsonl(tiny_tokenizer):
    import datasets

    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ds = datasets.Dataset.from_dict(
        {"messages": [good, [good[0], {"role": "gpt", "content": "yo"}]]}
    )
    with pytest.raises(
        DataError, match=r"train record 1: chat message 2 has unknown role 'gpt'"
    ) as err:
        batches.tokenize_counted(ds, "messages", tiny_tokenizer, DataConfig(num_proc=1))[0]
    assert "'assistant'" in err.value.hint


def test_malformed_json_message_reads_as_english(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "unterminated\n', encoding="utf-8")
    with pytest.raises(
        DataError, match=r"d\.jsonl:2: malformed JSON \(Unterminated string starting at column 10\)"
    ):
        data.file_source(str(p), 0.0)


def _build(tmp_path, model_dir, name: str, text: str, **data_cfg):
    from onegpu.config import from_dict
    from onegpu.training.data import build_data

    (tmp_path / name).write_text(text)
    data_cfg = {"path": str(tmp_path / name), "seq_len": 32, "num_proc": 1, **data_cfg}
    cfg = from_dict({"data": data_cfg, "model": {"name": str(model_dir)}})
    return build_data(cfg, str(model_dir))


def test_data_without_validation_examples_warns_why_and_the_fix(tmp_path, tiny_model_dir, caplog):
    """'val loss n/a' at every evaluation, silently, otherwise: one text file (one record, nothing
    to hold out), and 20 short records whose one held-out record fills no whole block."""
    import logging

    caplog.set_level(logging.WARNING, logger="onegpu.training.data")
    one = _build(tmp_path, tiny_model_dir, "one.txt", "def f(x):\n    return x\n" * 50)
    assert one.val_ds is None
    assert "no validation examples: 1 record(s) in the data (a text file is one record)" in (
        caplog.text
    )
    assert "set data.val_fraction 0 to train without validation" in caplog.text
    caplog.clear()
    rows = "".join(
        json.dumps({"text": f"def f{i}(x):\n    return {i}\n"}) + "\n" for i in range(20)
    )
    short = _build(tmp_path, tiny_model_dir, "short.jsonl", rows)
    assert len(short.val_ds) == 0
    assert "the 1 held-out record(s) fill no whole 32-token block" in caplog.text
    assert "fix: raise data.val_fraction, or lower data.seq_len" in caplog.text
    caplog.clear()
    _build(tmp_path, tiny_model_dir, "none.txt", "def f(x):\n    return x\n" * 50, val_fraction=0)
    assert "no validation examples" not in caplog.text  # asked for: nothing to warn about
