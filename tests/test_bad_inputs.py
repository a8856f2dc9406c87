"""The bad-input catalogue (docs/guarantees.md): each case through `onegpu train` as a user runs it.

Every case must give one clear error naming the field/file/line and the fix, exit code 2, no
traceback (unless --debug), and leave nothing behind: the run directory is created only after
all inputs were checked, so no case may create it (and an existing one stays untouched).
"""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest

from onegpu import hardware
from onegpu.cli.main import main

from test_resume import one_thread, write_data  # noqa: F401

Case = namedtuple("Case", "id args expect patch", defaults=(None,))


def _file(name: str, content, mode: str = "w"):
    def make(tmp, model_dir):
        path = tmp / name
        if mode == "wb":
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return ["--data.path", str(path)]

    return make


def _yaml(text: str):
    def make(tmp, model_dir):
        (tmp / "run.yaml").write_text(text, encoding="utf-8")
        return ["--config", str(tmp / "run.yaml")]

    return make


def _folder(*files):
    def make(tmp, model_dir):
        folder = tmp / "folder"
        folder.mkdir()
        for name in files:
            (folder / name).write_text('{"text": "x y z"}\n' if name.endswith(".jsonl") else "x y z\n")
        return ["--data.path", str(folder)]

    return make


def _damaged_checkpoint(tmp, model_dir):
    ckpt = tmp / "runs" / "old" / "checkpoint-00000003"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (ckpt / "trainer_state.pt").write_bytes(b"xx")
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"state.json": {"size": 1, "sha256": "0"},
                                                              "trainer_state.pt": {"size": 2, "sha256": "0"}}}))
    return ["--output.resume", str(ckpt), "--output.name", "new"]


def _fake_t4(monkeypatch):
    monkeypatch.setattr(hardware, "detect", lambda: hardware.DeviceInfo("cuda", "Tesla T4", 16 * 2**30, (7, 5)))


def _full_disk(monkeypatch):
    import shutil as sh

    usage = sh.disk_usage("/")
    monkeypatch.setattr(sh, "disk_usage", lambda path: usage._replace(free=1024))


def _occupied(tmp, model_dir):
    (tmp / "runs" / "taken").mkdir(parents=True)
    (tmp / "runs" / "taken" / "notes.txt").write_text("mine")
    return ["--output.name", "taken"]


def _under_a_file(tmp, model_dir):
    (tmp / "afile").write_text("x")
    return ["--output.dir", str(tmp / "afile" / "runs")]


CASES = [
    # data files
    Case("data-missing", ["--data.path", "/nonexistent/data.jsonl"], "data.path '/nonexistent/data.jsonl' does not exist"),
    Case("data-empty", _file("empty.jsonl", ""), "empty.jsonl: file is empty"),
    Case("data-blank-text", _file("blank.txt", "\n\n  \n"), "blank.txt: file is empty"),
    Case("data-bad-json-line", _file("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c"\n'),
         "bad.jsonl:3: malformed JSON"),
    Case("data-json-not-object", _file("list.jsonl", '{"text": "a"}\n[1, 2]\n'), "list.jsonl:2: expected a JSON object"),
    Case("data-not-utf8", _file("latin.txt", b"def f():\n    return '\xe9t\xe9'\n", "wb"), "latin.txt:2: not valid UTF-8"),
    Case("data-corrupt-parquet", _file("broken.parquet", b"PAR1 this is not parquet at all", "wb"), "cannot read"),
    Case("data-unsupported-type", _file("data.xyz", "hello"), "unsupported file type"),
    Case("data-empty-folder", lambda tmp, md: (tmp / "nothing").mkdir() or ["--data.path", str(tmp / "nothing")],
         "no data files in"),
    Case("data-mixed-folder", _folder("a.jsonl", "b.txt"), "mixes file types"),
    Case("data-wrong-columns", _file("cols.jsonl", '{"body": "a"}\n' * 20), "cannot tell the data format from columns"),
    Case("data-format-missing-column", lambda tmp, md: ["--data.format", "prompt_completion"],
         "data.format=prompt_completion needs column(s)"),
    Case("data-text-field-typo", lambda tmp, md: ["--data.format", "text", "--data.text_field", "txt"],
         "set data.text_field to one of the columns: text"),
    Case("data-prompt-not-string", _file("pc.jsonl", '{"prompt": 5, "completion": "six"}\n' * 20),
         "prompt/completion must be strings"),
    Case("data-bad-chat-message", _file("chat.jsonl", json.dumps({"messages": [{"content": "hi"}]}) + "\n"),
         "needs 'role' and 'content'"),
    Case("data-too-few-examples", ["--training.micro_batch_size", "5000"], "training examples for a micro-batch of 5000"),
    Case("seq-len-above-model", ["--data.seq_len", "512"], "data.seq_len=512 exceeds the model's max_position_embeddings=256"),
    # model
    Case("model-unknown-offline", ["--model.name", "no-such-org/no-such-model"], "cannot load tokenizer 'no-such-org/no-such-model'"),
    Case("model-dir-without-config", lambda tmp, md: (tmp / "m").mkdir() or ["--model.name", str(tmp / "m"),
                                                                               "--model.tokenizer", str(md)],
         "has no config.json"),
    Case("tokenizer-missing", ["--model.tokenizer", "/nonexistent/tok"], "tokenizer directory '/nonexistent/tok' does not exist"),
    Case("lora-target-matches-nothing", ["--techniques.lora.enabled", "true", "--techniques.lora.targets", "nope_proj"],
         "techniques.lora.targets"),
    # names and values
    Case("optimizer-unknown", ["--techniques.optimizer", "adamm"], "did you mean 'adamw'"),
    Case("precision-unknown", ["--techniques.precision", "fp8"], "techniques.precision: invalid value 'fp8'"),
    Case("bf16-on-t4", ["--techniques.precision", "bf16"], "Tesla T4 (compute capability 7.5) has no bf16 support", _fake_t4),
    Case("micro-batch-zero", ["--training.micro_batch_size", "0"], "training.micro_batch_size must be a positive integer"),
    Case("lr-negative", ["--training.lr", "-0.1"], "training.lr must not be negative"),
    Case("seq-len-negative", ["--data.seq_len", "-8"], "data.seq_len must be a positive integer"),
    Case("val-fraction-out-of-range", ["--data.val_fraction", "1.5"], "data.val_fraction must be in [0, 1)"),
    Case("max-steps-not-a-number", ["--training.max_steps", "many"], "training.max_steps"),
    Case("max-bad-steps-negative", ["--training.max_bad_steps", "-1"], "training.max_bad_steps must not be negative"),
    # YAML and command line
    Case("yaml-unknown-key", _yaml("training:\n  max_step: 5\n"), "did you mean 'training.max_steps'"),
    Case("yaml-bad-syntax", _yaml("training:\n  max_steps: 5\n   lr: [\n"), "line 3"),
    Case("yaml-missing-file", ["--config", "/nonexistent/run.yaml"], "config file not found: /nonexistent/run.yaml"),
    Case("yaml-not-a-mapping", _yaml("- a\n- b\n"), "the top level must be a mapping"),
    Case("yaml-wrong-type", _yaml("training:\n  max_steps: many\n"), "training.max_steps must be an integer"),
    Case("cli-unknown-flag", ["--training.maxsteps", "5"], "did you mean '--training.max_steps'"),
    # conflicts
    Case("offload-with-torchao-optimizer", ["--techniques.offload", "zero2-cpu", "--techniques.optimizer", "adamw-8bit-ao"],
         "cannot be combined with techniques.optimizer=adamw-8bit-ao"),
    Case("quantized-base-without-lora", ["--techniques.lora.quantize_base", "nf4"], "needs LoRA"),
    Case("resume-and-overwrite", ["--output.resume", "latest", "--output.overwrite", "true"], "contradict each other"),
    # output directory
    Case("output-not-empty", _occupied, "is not empty"),
    Case("output-unwritable", _under_a_file, "is not a writable folder"),
    Case("output-disk-full", [], "not enough free disk for checkpoints", _full_disk),
    Case("resume-latest-nothing-there", ["--output.resume", "latest", "--output.name", "fresh"], "does not exist"),
    Case("resume-path-missing", ["--output.resume", "/nonexistent/checkpoint-00000001"], "does not exist"),
    Case("resume-damaged-checkpoint", _damaged_checkpoint, "is damaged"),
]


def base_args(tmp, model_dir) -> list[str]:
    data = write_data(tmp, n=40)
    return ["train", "--model.name", str(model_dir), "--data.path", str(data), "--data.seq_len", "32",
            "--data.num_proc", "1", "--training.micro_batch_size", "2", "--training.max_steps", "2",
            "--training.eval_every", "0", "--output.dir", str(tmp / "runs"), "--output.name", "run",
            "--output.tensorboard", "false"]


def _snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, tiny_model_dir, capsys, monkeypatch):
    args = base_args(tmp_path, tiny_model_dir)
    args += case.args(tmp_path, tiny_model_dir) if callable(case.args) else case.args
    if case.patch:
        case.patch(monkeypatch)
    before = _snapshot(tmp_path / "runs")
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert case.expect in err, err
    assert "Traceback" not in err and err.count("error: ") == 1 and ("\n" + err).count("\nerror: ") == 1
    assert _snapshot(tmp_path / "runs") == before  # no run directory, no partial files


def test_catalogue_is_big_enough_and_documented():
    from pathlib import Path

    assert len(CASES) >= 30
    doc = (Path(__file__).parents[1] / "docs" / "guarantees.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"add these cases to docs/guarantees.md: {missing}"


def test_debug_shows_the_traceback(tmp_path, tiny_model_dir, capsys):
    code = main(base_args(tmp_path, tiny_model_dir) + ["--training.micro_batch_size", "0", "--debug"])
    assert code == 2 and "Traceback" in capsys.readouterr().err


def test_secrets_never_reach_saved_configs_or_logs(tmp_path, tiny_model_dir, monkeypatch, capsys):
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123"
    monkeypatch.setenv("HF_TOKEN", token)
    data = write_data(tmp_path, n=40)
    # the token's value inside a saved field (here: a path naming it) is blanked in every saved config
    code = main(base_args(tmp_path, tiny_model_dir) + ["--data.path", str(data), "--training.save_every", "1",
                                                       "--techniques.nvme_path", f"/tmp/{token}"])
    assert code == 0
    run = tmp_path / "runs" / "run"
    texts = [p.read_text(errors="ignore") for p in run.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl")]
    captured = capsys.readouterr()
    assert len(texts) >= 3 and all(token not in t for t in texts + [captured.out, captured.err])
    assert "nvme_path: /tmp/<redacted>" in (run / "config.yaml").read_text()
    from onegpu.config import redact

    assert redact({"model": {"name": f"x/{token}"}, "k": f"sk-{'a' * 24}"}) == {"model": {"name": "x/<redacted>"},
                                                                             "k": "<redacted>"}
    shutil.rmtree(run)
