"""One command-line style: underscores, `--section.field` for training settings in every command,
renamed flags kept as noted aliases, train --help grouped by section; and the end-of-run hint
that fits the data the model was trained on."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from onegpu.cli.args import renamed
from onegpu.cli.main import main
from onegpu.config import Config
from onegpu.report import generate_hint, sample_prompt

SECTIONS = ["model", "data", "training", "techniques", "techniques.lora", "output", "distributed"]


def _flags(cls, prefix: str = "") -> list[str]:
    """Every field of a config dataclass as its flag, nested sections included."""
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(
            f.default_factory if f.default_factory is not dataclasses.MISSING else None
        ):
            out += _flags(f.default_factory, f"{prefix}{f.name}.")
        else:
            out.append(f"--{prefix}{f.name}")
    return out


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_train_help_has_a_heading_per_section_every_flag_and_no_dataclass_signature(capsys):
    text = _help(capsys, "train")
    lines = text.splitlines()
    for section in SECTIONS:
        assert f"{section}:" in lines, section
    assert "Config(" not in text and "<factory>" not in text
    assert "type: " not in text  # Python type names are not help
    for flag in _flags(Config):
        assert f"  {flag} " in text or f"  {flag}\n" in text, flag
    assert "Tokens per training sequence" in text  # each flag with its field's docstring


def test_no_command_documents_a_hyphenated_flag(capsys):
    for command in ("train", "plan", "generate", "doctor"):
        text = _help(capsys, command)
        flags = [w for w in text.split() if w.startswith("--") and w[2:3].isalpha()]
        assert flags and not [f for f in flags if "-" in f[2:].split("=")[0].split("[")[0]], command


def test_plan_takes_train_flags_and_the_old_spellings_with_a_note(capsys):
    assert (
        main(
            [
                "plan",
                "tiny",
                "--gpu",
                "T4",
                "--data.seq_len",
                "128",
                "--training.micro_batch_size",
                "4",
                "--training.grad_accum",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (out["seq_len"], out["batch"]) == (128, 8)  # the batch of the train flags, kept
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny",
                "--gpu",
                "T4",
                "--seq-len",
                "96",
                "--memory-gib",
                "8",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["seq_len"] == 96
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --seq-len is now --data.seq_len (the old spelling still works, for now)",
        "note: --memory-gib is now --memory_gib (the old spelling still works, for now)",
    ]


def test_renamed_rewrites_both_forms_and_leaves_the_rest(capsys):
    names = {"--seq-len": "--data.seq_len"}
    assert renamed(["--seq-len", "64", "--seq-len=32", "x", "--top", "3"], names) == [
        "--data.seq_len",
        "64",
        "--data.seq_len=32",
        "x",
        "--top",
        "3",
    ]
    assert capsys.readouterr().err.count("--seq-len is now --data.seq_len") == 2


def test_hint_fits_the_data_format():
    data = Config().data
    data.path = "my.jsonl"
    long = (
        "Explain, in a few words, why the sky looks blue on a clear summer afternoon and red at "
        "dusk"
    )
    chat = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": "A sequence."},
            ]
        }
    ]
    assert sample_prompt(chat, "messages", data) == "What is a list?"
    assert (
        generate_hint("runs/r/final", "messages", "What is a list?")
        == 'onegpu generate --model runs/r/final --chat true "What is a list?"'
    )
    short = sample_prompt(
        [{"prompt": long + "\nsecond line", "completion": "x"}], "prompt_completion", data
    )
    assert (
        long.startswith(short) and len(short) <= 60 and not short.endswith(" ")
    )  # shortened at a word
    assert sample_prompt([{"text": "\n  import os\nprint(1)"}], "text", data) == "import os"
    assert (
        generate_hint("runs/r/final", "text", None)
        == 'onegpu generate --model runs/r/final "def fib("'
    )
    data.path = None  # the default standard-library corpus: the code snippet
    assert sample_prompt([{"text": "import os"}], "text", data) is None
    assert (
        generate_hint("r", "text", "echo $HOME") == "onegpu generate --model r 'echo $HOME'"
    )  # the shell leaves it


def test_a_chat_run_records_its_format_and_hints_a_chat_turn(tmp_path, capsys):
    from onegpu import train
    from onegpu.infer import InferConfig, load

    turns = [f"question {i}: what does list.append return?" for i in range(24)]
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": t},
                        {"role": "assistant", "content": "None."},
                    ]
                }
            )
            + "\n"
            for t in turns
        )
    )
    train(
        {
            "model": {"name": "tiny", "vocab_size": 300},
            "data": {"path": str(path), "seq_len": 32, "num_proc": 1},
            "training": {"micro_batch_size": 2, "max_steps": 1, "eval_every": 0, "eval_batches": 1},
            "output": {"dir": str(tmp_path), "name": "run"},
        }
    )
    hint = next(
        line for line in capsys.readouterr().out.splitlines() if "try: onegpu generate" in line
    )
    assert f'--model {tmp_path / "run" / "final"} --chat true "' in hint
    assert hint.split("--chat true ")[1].strip('"') in turns
    assert (
        yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["format"]
        == "messages"
    )
    assert (
        load(InferConfig(model=str(tmp_path / "run"))).data_format == "messages"
    )  # generate's auto: chat
