"""Records longer than data.seq_len: each policy (truncate, drop, split) for chat and
prompt/completion, never a cut assistant turn trained on as if whole, and the counts reported at
start (one log line per split) and in the run summary."""

from __future__ import annotations

import json
import logging

import pytest

from onegpu.config import DataConfig
from onegpu.data import batches
from onegpu.data.overlong import IGNORE

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded


SYSTEM = {"role": "system", "content": "You write Python."}


def exchange(i: int, answer: str | None = None) -> list[dict]:
    return [
        {"role": "user", "content": f"question {i}: print the numbers"},
        {"role": "assistant", "content": answer or f"for i in range({i}):\n    print(i * i)\n"},
    ]


def tokenize(tok, fmt, rows, seq_len, policy, **kw):
    import datasets

    cfg = DataConfig(seq_len=seq_len, num_proc=kw.pop("num_proc", 1), overlong=policy)
    return batches.tokenize_counted(datasets.Dataset.from_dict(rows), fmt, tok, cfg, **kw)


def trained_spans(tok, ex) -> list[str]:
    """The decoded runs of consecutive target tokens of one example."""
    spans, cur = [], []
    for t, lab in zip(ex["input_ids"], ex["labels"], strict=True):
        if lab != IGNORE:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return [tok.decode(s) for s in spans + ([cur] if cur else [])]


# A system message (18 tokens) plus one exchange (38) fits in 70 tokens; two exchanges do not.
CONV = [SYSTEM] + exchange(1) + exchange(2) + exchange(3)
SEQ = 70


def test_chat_that_fits_is_untouched(tiny_tokenizer):
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [CONV]}, 256, "split")
    assert len(out) == 1 and stats.overlong == 0 and stats.records == 1
    assert len(trained_spans(tiny_tokenizer, out[0])) == 3


def test_truncate_never_trains_on_the_cut_turn(tiny_tokenizer):
    seq = 80  # the cut falls inside the second assistant turn
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [CONV]}, seq, "truncate")
    assert (stats.overlong, stats.truncated, stats.dropped, len(out)) == (1, 1, 0, 1)
    ex = out[0]
    text = tiny_tokenizer.decode(ex["input_ids"])
    assert len(ex["input_ids"]) == seq
    assert text.endswith("<|assistant|>for i")  # the cut turn is still context...
    spans = trained_spans(tiny_tokenizer, ex)
    assert spans == [
        "for i in range(1):\n    print(i * i)\n<|eos|>"
    ]  # ...but only whole turns are targets
    assert (
        "records longer than data.seq_len=80 (data.overlong=truncate): 1 truncated"
        in stats.describe()
    )


def test_truncate_that_leaves_nothing_to_learn_is_dropped_and_counted(tiny_tokenizer):
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [CONV]}, 30, "truncate")
    assert len(out) == 0 and (stats.overlong, stats.truncated, stats.dropped) == (1, 0, 1)


def test_drop_removes_and_counts(tiny_tokenizer):
    short = [SYSTEM] + exchange(1)
    out, stats = tokenize(
        tiny_tokenizer, "messages", {"messages": [CONV, short, CONV]}, SEQ, "drop"
    )
    assert len(out) == 1 and (stats.records, stats.overlong, stats.dropped, stats.examples) == (
        3,
        2,
        2,
        1,
    )
    assert stats.describe() == (
        "train: 2 of 3 records longer than data.seq_len=70 (data.overlong=drop): 2 dropped"
    )


def test_split_cuts_on_turn_boundaries_and_every_example_ends_its_turns(tiny_tokenizer):
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [CONV]}, SEQ, "split")
    assert (stats.overlong, stats.split_records, stats.split_examples, stats.dropped) == (
        1,
        1,
        3,
        0,
    )
    assert len(out) == 3
    eos = tiny_tokenizer.eos_token_id
    for i, ex in enumerate(out, 1):
        text = tiny_tokenizer.decode(ex["input_ids"])
        assert len(ex["input_ids"]) <= SEQ
        assert text.startswith("<|system|>You write Python.<|end|>")  # the context is kept
        assert trained_spans(tiny_tokenizer, ex) == [
            f"for i in range({i}):\n    print(i * i)\n<|eos|>"
        ]
        assert (
            ex["input_ids"][-1] == eos and ex["labels"][-1] == eos
        )  # the turn ends with a trained EOS
    assert "1 split on turn boundaries into 3 examples" in stats.describe()


def test_split_leaves_out_a_turn_too_long_on_its_own(tiny_tokenizer):
    conv = [SYSTEM] + exchange(1) + exchange(2, "print('x')\n" * 40) + exchange(3)
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [conv]}, SEQ, "split")
    assert stats.turns_left_out == 1 and stats.split_examples == 2
    assert [trained_spans(tiny_tokenizer, ex)[0][:17] for ex in out] == [
        "for i in range(1)",
        "for i in range(3)",
    ]
    assert "1 assistant turn(s) longer than seq_len on their own left out" in stats.describe()


def test_split_gives_up_the_system_message_before_the_turn(tiny_tokenizer):
    # 50 tokens hold one exchange (38) but not with the system message (18) in front
    out, stats = tokenize(tiny_tokenizer, "messages", {"messages": [CONV]}, 50, "split")
    assert len(out) == 3 and stats.turns_left_out == 0
    assert all(tiny_tokenizer.decode(ex["input_ids"]).startswith("<|user|>") for ex in out)


def test_split_with_several_processes_counts_the_same(tiny_tokenizer):
    rows = {"messages": [CONV, [SYSTEM] + exchange(1)] * 4}
    one, a = tokenize(tiny_tokenizer, "messages", rows, SEQ, "split")
    two, b = tokenize(tiny_tokenizer, "messages", rows, SEQ, "split", num_proc=2)
    assert a == b and one["input_ids"] == two["input_ids"] and len(one) == 4 * 3 + 4


PROMPT = "Q: " + "add the numbers one and two and three " * 6 + "\nA:"
COMPLETION = " six"


def test_prompt_completion_under_each_policy(tiny_tokenizer):
    tok = tiny_tokenizer
    p_len = len(tok(PROMPT)["input_ids"])
    c_ids = tok(COMPLETION, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq = p_len  # the prompt alone fills it: the completion would be cut off
    rows = {"prompt": [PROMPT, "Q: 1+1\nA:"], "completion": [COMPLETION, " 2"]}
    for policy in ("drop", "split"):  # split: no turn boundary to cut on, so the record is dropped
        out, stats = tokenize(tok, "prompt_completion", rows, seq, policy)
        assert len(out) == 1 and (stats.overlong, stats.dropped) == (1, 1), policy
    out, stats = tokenize(tok, "prompt_completion", rows, seq, "truncate")
    assert len(out) == 2 and (stats.overlong, stats.truncated, stats.dropped) == (1, 1, 0)
    ex = out[0]
    assert len(ex["input_ids"]) == seq
    assert (
        ex["input_ids"][-len(c_ids) :] == c_ids and ex["labels"][-len(c_ids) :] == c_ids
    )  # whole, with EOS
    assert ex["labels"][: seq - len(c_ids)] == [IGNORE] * (seq - len(c_ids))
    assert tok.decode(ex["input_ids"]).endswith(
        "one and two and three \nA: six<|eos|>"
    )  # the prompt's end kept
    # a completion that does not fit on its own is dropped, never cut
    out, stats = tokenize(
        tok,
        "prompt_completion",
        {"prompt": ["Q:"], "completion": [COMPLETION * 30]},
        16,
        "truncate",
    )
    assert len(out) == 0 and stats.dropped == 1


def test_raw_text_is_packed_and_reports_nothing_lost(tiny_tokenizer):
    out, stats = tokenize(
        tiny_tokenizer, "text", {"text": ["def f(x):\n    return x\n" * 30] * 3}, 16, "split"
    )
    assert len(out) > 3 and stats.overlong == 0 and stats.records == 3
    assert (
        stats.describe()
        == "train: 0 of 3 records cut (raw text is packed into 16-token blocks: nothing is lost)"
    )


def test_counts_in_the_log_and_the_summary(tmp_path, tiny_model_dir, caplog, capsys):
    from onegpu import train

    recs = [{"messages": CONV} for _ in range(10)] + [
        {"messages": [SYSTEM] + exchange(i % 5)} for i in range(30)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = {
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(data), "seq_len": SEQ, "num_proc": 1, "val_fraction": 0.1},
        "training": {"micro_batch_size": 2, "max_steps": 1, "eval_every": 0, "eval_batches": 1},
        "output": {"dir": str(tmp_path / "runs"), "name": "run", "report_to": "none"},
    }
    caplog.set_level(logging.INFO)
    result = train(cfg)
    train_stats, val_stats = result.data_stats
    assert (train_stats.split, val_stats.split) == ("train", "validation")
    assert train_stats.records + val_stats.records == 40
    assert train_stats.overlong + val_stats.overlong == 10
    assert train_stats.split_examples == 3 * train_stats.split_records
    logged = [
        r.getMessage()
        for r in caplog.records
        if "records longer than data.seq_len" in r.getMessage()
    ]
    assert logged == [f"data {train_stats.describe()}", f"data {val_stats.describe()}"]
    assert (
        f"of {train_stats.records} records longer than data.seq_len=70 (data.overlong=split)"
        in logged[0]
    )
    out = capsys.readouterr().out
    assert f"data {train_stats.describe()}\ndata {val_stats.describe()}\n" in out


def test_policy_is_a_checked_config_value():
    from onegpu.config import from_dict
    from onegpu.errors import ConfigError

    assert from_dict({}).data.overlong == "split"
    with pytest.raises(ConfigError, match="data.overlong: invalid value 'cut'"):
        from_dict({"data": {"overlong": "cut"}})


def test_a_pair_with_an_empty_response_is_dropped_and_counted(tiny_tokenizer):
    """An empty chosen (or blank rejected) response would still tokenize to its EOS and be
    trained on: the pair is left out and counted, in the line the start and the summary print."""
    rows = {
        "prompt": ["def f(x):", "def g(x):", "def h(x):"],
        "chosen": ["    return x", "", "    return 2"],
        "rejected": ["    pass", "    pass", " \n"],
    }
    out, stats = tokenize(tiny_tokenizer, "preference", rows, 64, "drop")
    assert len(out) == 1 and stats.records == 3 and stats.empty == 2 and stats.overlong == 0
    assert stats.describe() == (
        "train: 0 of 3 records longer than data.seq_len=64 (data.overlong=drop): "
        "2 pair(s) with an empty chosen or rejected response dropped"
    )
    answer = [{"role": "assistant", "content": "    return x"}]
    chat = {"chosen": [[{"role": "assistant", "content": ""}]], "rejected": [answer]}
    chat["prompt"] = [[{"role": "user", "content": "write f"}]]
    out, stats = tokenize(tiny_tokenizer, "preference", chat, 64, "drop")
    assert len(out) == 0 and stats.empty == 1
