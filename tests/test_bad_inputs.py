"""The bad-input catalogue (docs/guarantees.md): each case through `onegpu train` as a user runs it.

Every case must give one clear error naming the field/file/line and the fix, exit code 2, no
traceback (unless --debug), and leave nothing behind: the run directory is created only after
all inputs were checked, so no case may create it (and an existing one stays untouched).
"""

from __future__ import annotations

import errno
import json
import shutil
import sys
import tempfile
from collections import namedtuple

import pytest

from helpers import write_data
from onegpu import hardware
from onegpu.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded

# absent: text the error must not hold (a misleading hint, a message cut short)
Case = namedtuple("Case", "id args expect patch absent", defaults=(None, ()))


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
            (folder / name).write_text(
                '{"text": "x y z"}\n' if name.endswith(".jsonl") else "x y z\n"
            )
        return ["--data.path", str(folder)]

    return make


def _damaged_checkpoint(tmp, model_dir):
    ckpt = tmp / "runs" / "old" / "checkpoint-00000003"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    (ckpt / "trainer_state.pt").write_bytes(b"xx")
    (ckpt / "manifest.json").write_text(
        json.dumps(
            {
                "files": {
                    "state.json": {"size": 1, "sha256": "0"},
                    "trainer_state.pt": {"size": 2, "sha256": "0"},
                }
            }
        )
    )
    return ["--output.resume", str(ckpt), "--output.name", "new"]


def _other_shape_checkpoint(tmp, model_dir):
    """A real checkpoint of a narrower model (hidden 32 instead of 64) to resume from."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from helpers import make_tiny_llama
    from onegpu.checkpoint import local

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = make_tiny_llama(tok, hidden_size=32, intermediate_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {"step": 1, "batches_seen": 2, "tokens_seen": 0, "best_eval": 1.0, "history": []}
    ckpt = local.save_checkpoint(
        tmp / "runs" / "old", 1, model, opt, sched, state, Accelerator(cpu=True), tok
    )
    return ["--output.resume", str(ckpt), "--output.name", "new"]


def _fake_t4(monkeypatch, tmp):
    monkeypatch.setattr(
        hardware, "detect", lambda: hardware.DeviceInfo("cuda", "Tesla T4", 16 * 2**30, (7, 5))
    )


def _full_disk(monkeypatch, tmp):
    import shutil as sh

    usage = sh.disk_usage("/")
    monkeypatch.setattr(sh, "disk_usage", lambda path: usage._replace(free=1024))


def _read_only_mount(monkeypatch, tmp):
    """A read-only mount as root (or a network/FUSE mount) sees it: os.access says writable, the
    filesystem reports no free space, and creating a file fails with EROFS."""
    import os
    import shutil as sh

    usage = sh.disk_usage("/")
    mount = str(tmp / "mnt")
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kw):
        if dir is not None and str(dir).startswith(mount):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_mkstemp(*args, dir=dir, **kw)

    monkeypatch.setattr(os, "access", lambda *a, **k: True)
    monkeypatch.setattr(sh, "disk_usage", lambda path: usage._replace(free=0))
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def _read_only_output(tmp, model_dir):
    (tmp / "mnt").mkdir()
    return ["--output.dir", str(tmp / "mnt" / "runs")]


def _in_folder(monkeypatch, tmp):
    monkeypatch.chdir(tmp)


def _bitsandbytes(body: str):
    """Make `import bitsandbytes` find a package whose own import fails (body raises), or none."""

    def patch(monkeypatch, tmp):
        for name in [
            m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")
        ]:
            monkeypatch.delitem(sys.modules, name)
        if body is None:
            monkeypatch.setitem(
                sys.modules, "bitsandbytes", None
            )  # import raises ModuleNotFoundError for it
            return
        pkg = tmp / "site" / "bitsandbytes"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp / "site"))

    return patch


def _occupied(tmp, model_dir):
    (tmp / "runs" / "taken").mkdir(parents=True)
    (tmp / "runs" / "taken" / "notes.txt").write_text("mine")
    return ["--output.name", "taken"]


def _pairs_line5_without_rejected(tmp, model_dir):
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(20)]
    del rows[4]["rejected"]  # file line 5
    path = tmp / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return ["--data.path", str(path), "--training.objective", "dpo"]


def _readme_only(tmp, model_dir):
    (tmp / "m").mkdir()
    (tmp / "m" / "README.md").write_text("# my model\n")
    return ["--model.name", str(tmp / "m")]


def _sft_checkpoint(tmp, model_dir):
    from onegpu import train

    train(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(write_data(tmp, n=40)), "seq_len": 32, "num_proc": 1},
            "training": {"micro_batch_size": 2, "max_steps": 1, "eval_every": 0, "save_every": 1},
            "output": {"dir": str(tmp / "runs"), "name": "sft", "report_to": "none"},
        }
    )
    return ["--output.name", "sft", "--output.resume", "latest", "--training.objective", "dpo"]


def _under_a_file(tmp, model_dir):
    (tmp / "afile").write_text("x")
    return ["--output.dir", str(tmp / "afile" / "runs")]


CASES = [
    # data files
    Case(
        "data-missing",
        ["--data.path", "/nonexistent/data.jsonl"],
        "data.path '/nonexistent/data.jsonl' does not exist",
    ),
    Case("data-empty", _file("empty.jsonl", ""), "empty.jsonl: file is empty"),
    Case("data-blank-text", _file("blank.txt", "\n\n  \n"), "blank.txt: file is empty"),
    Case(
        "data-bad-json-line",
        _file("bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": "c"\n'),
        "bad.jsonl:3: malformed JSON",
    ),
    Case(
        "data-bad-json-unterminated",
        _file("cut.jsonl", '{"text": "a"}\n{"text": "abc\n'),
        "cut.jsonl:2: malformed JSON (Unterminated string starting at column 10)",
    ),
    Case(
        "data-json-not-object",
        _file("list.jsonl", '{"text": "a"}\n[1, 2]\n'),
        "list.jsonl:2: expected a JSON object",
    ),
    Case(
        "data-not-utf8",
        _file("latin.txt", b"def f():\n    return '\xe9t\xe9'\n", "wb"),
        "latin.txt:2: not valid UTF-8",
    ),
    Case(
        "data-corrupt-parquet",
        _file("broken.parquet", b"PAR1 this is not parquet at all", "wb"),
        "cannot read",
    ),
    Case("data-unsupported-type", _file("data.xyz", "hello"), "unsupported file type"),
    Case(
        "data-empty-folder",
        lambda tmp, md: (tmp / "nothing").mkdir() or ["--data.path", str(tmp / "nothing")],
        "no data files in",
    ),
    Case("data-mixed-folder", _folder("a.jsonl", "b.txt"), "mixes file types"),
    Case(
        "data-wrong-columns",
        _file("cols.jsonl", '{"body": "a"}\n' * 20),
        "cannot tell the data format from columns",
    ),
    Case(
        "data-format-missing-column",
        lambda tmp, md: ["--data.format", "prompt_completion"],
        "data.format=prompt_completion needs column(s)",
    ),
    Case(
        "data-text-field-typo",
        lambda tmp, md: ["--data.format", "text", "--data.text_field", "txt"],
        "set data.text_field to one of the columns: text",
    ),
    Case(
        "data-prompt-not-string",
        _file("pc.jsonl", '{"prompt": 5, "completion": "six"}\n' * 20),
        "prompt/completion must be strings",
    ),
    # the file's own line (blank lines counted), not the record's place in a shuffled split
    Case(
        "data-prompt-not-string-names-line",
        lambda tmp, md: (
            _file("pc.jsonl", "\n\n" + '{"prompt": 5, "completion": "six"}\n' * 20)(tmp, md)
            + ["--data.val_fraction", "0"]
        ),
        "pc.jsonl:3: prompt/completion must be strings, got int/str",
    ),
    Case(
        "data-bad-chat-message",
        _file("chat.jsonl", json.dumps({"messages": [{"content": "hi"}]}) + "\n"),
        "chat.jsonl:1: malformed chat message 1 {'content': 'hi'}: needs 'role' and 'content'",
    ),
    Case(
        "data-unknown-chat-role",
        _file(
            "roles.jsonl",
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"},
                    ]
                }
            )
            + "\n"
            + json.dumps(
                {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}
            )
            + "\n",
        ),
        (
            "roles.jsonl:2: chat message 2 has unknown role 'bot'",
            "rename e.g. 'bot' or 'gpt' to 'assistant'",
        ),
    ),
    Case(
        "data-relative-path-missing",
        ["--data.path", "data/train.jsonl"],
        (
            "data.path 'data/train.jsonl' does not exist (looked for ",
            "/data/train.jsonl: relative paths are read from ",
        ),
        _in_folder,
    ),
    Case(
        "data-all-records-overlong",
        lambda tmp, md: (
            _file(
                "long.jsonl",
                (
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": "write a loop " * 9},
                                {"role": "assistant", "content": "ok"},
                            ]
                        }
                    )
                    + "\n"
                )
                * 20,
            )(tmp, md)
            + ["--data.seq_len", "16", "--data.overlong", "drop"]
        ),
        (
            "no training examples after tokenization: train: 19 of 19 records longer than "
            "data.seq_len=16 (data.overlong=drop): 19 dropped",
            "choose another data.overlong",
        ),
    ),
    Case(
        "data-too-few-examples",
        ["--training.micro_batch_size", "5000"],
        "training examples for a micro-batch of 5000",
    ),
    Case(
        "seq-len-above-model",
        ["--data.seq_len", "512"],
        "data.seq_len=512 exceeds the model's max_position_embeddings=256",
    ),
    # with this little data, tokenizing first used to report "no training examples" instead
    Case(
        "seq-len-above-model-little-data",
        ["--data.seq_len", "8192"],
        (
            "data.seq_len=8192 exceeds the model's max_position_embeddings=256",
            "set data.seq_len <= 256",
        ),
    ),
    # model
    Case(
        "model-unknown-offline",
        ["--model.name", "no-such-org/no-such-model"],
        "cannot load tokenizer 'no-such-org/no-such-model'",
    ),
    Case(
        "model-dir-without-config",
        lambda tmp, md: (
            (tmp / "m").mkdir() or ["--model.name", str(tmp / "m"), "--model.tokenizer", str(md)]
        ),
        "has no config.json",
    ),
    Case(
        "model-dir-readme-only",
        _readme_only,
        (
            "/m' holds no tokenizer (no tokenizer.json or tokenizer_config.json) and no "
            "config.json; it holds README.md",
            "folder written by save_pretrained",
        ),
        absent=("one of:", "give a local directory"),
    ),
    Case(
        "tokenizer-missing",
        ["--model.tokenizer", "/nonexistent/tok"],
        "tokenizer directory '/nonexistent/tok' does not exist",
    ),
    Case(
        "lora-target-matches-nothing",
        ["--techniques.lora.enabled", "true", "--techniques.lora.targets", "nope_proj"],
        "techniques.lora.targets",
    ),
    # names and values
    Case("optimizer-unknown", ["--techniques.optimizer", "adamm"], "did you mean 'adamw'"),
    Case(
        "precision-unknown",
        ["--techniques.precision", "fp8"],
        "techniques.precision: invalid value 'fp8'",
    ),
    Case(
        "bf16-on-t4",
        ["--techniques.precision", "bf16"],
        "Tesla T4 (compute capability 7.5) has no bf16 support",
        _fake_t4,
    ),
    Case(
        "micro-batch-zero",
        ["--training.micro_batch_size", "0"],
        "training.micro_batch_size must be a positive integer",
    ),
    Case("lr-negative", ["--training.lr", "-0.1"], "training.lr must not be negative"),
    Case("seq-len-negative", ["--data.seq_len", "-8"], "data.seq_len must be a positive integer"),
    Case(
        "val-fraction-out-of-range",
        ["--data.val_fraction", "1.5"],
        "data.val_fraction must be in [0, 1)",
    ),
    Case(
        "max-steps-not-a-number",
        ["--training.max_steps", "many"],
        ("training.max_steps must be an integer, got 'many'", "--training.max_steps 200"),
    ),
    Case("lr-not-a-number", ["--training.lr", "fast"], "training.lr must be a number, got 'fast'"),
    Case(
        "max-bad-steps-negative",
        ["--training.max_bad_steps", "-1"],
        "training.max_bad_steps must not be negative",
    ),
    # YAML and command line
    Case(
        "yaml-unknown-key", _yaml("training:\n  max_step: 5\n"), "did you mean 'training.max_steps'"
    ),
    Case("yaml-bad-syntax", _yaml("training:\n  max_steps: 5\n   lr: [\n"), "line 3"),
    Case(
        "yaml-missing-file",
        ["--config", "/nonexistent/run.yaml"],
        "config file not found: /nonexistent/run.yaml",
    ),
    Case("yaml-not-a-mapping", _yaml("- a\n- b\n"), "the top level must be a mapping"),
    Case(
        "yaml-wrong-type",
        _yaml("training:\n  max_steps: many\n"),
        "training.max_steps must be an integer",
    ),
    Case("cli-unknown-flag", ["--training.maxsteps", "5"], "did you mean '--training.max_steps'"),
    Case(
        "cli-flag-from-another-trainer",
        ["--training.learnig_rate", "0.1"],
        ("unknown option '--training.learnig_rate'", "did you mean '--training.lr'"),
    ),
    Case(
        "cli-field-in-wrong-section", ["--training.seq_len", "64"], "did you mean '--data.seq_len'"
    ),
    # conflicts
    Case(
        "offload-with-torchao-optimizer",
        ["--techniques.offload", "zero2-cpu", "--techniques.optimizer", "adamw-8bit-ao"],
        "cannot be combined with techniques.optimizer=adamw-8bit-ao",
    ),
    Case("quantized-base-without-lora", ["--techniques.lora.quantize_base", "nf4"], "needs LoRA"),
    Case(
        "resume-and-overwrite",
        ["--output.resume", "latest", "--output.overwrite", "true"],
        "contradict each other",
    ),
    # output directory
    Case("output-not-empty", _occupied, "is not empty"),
    Case("output-unwritable", _under_a_file, "is not a writable folder"),
    Case("output-disk-full", [], "not enough free disk for checkpoints", _full_disk),
    Case(
        "resume-latest-nothing-there",
        ["--output.resume", "latest", "--output.name", "fresh"],
        "does not exist",
    ),
    Case(
        "resume-path-missing",
        ["--output.resume", "/nonexistent/checkpoint-00000001"],
        "does not exist",
    ),
    Case("resume-damaged-checkpoint", _damaged_checkpoint, "is damaged"),
    Case(
        "resume-with-another-objective",
        _sft_checkpoint,
        (
            "was trained with training.objective=sft; this run asks for dpo",
            "resume with --training.objective sft",
            "without --output.resume",
        ),
        absent=("reference",),
    ),
    Case(
        "resume-other-model-shape",
        _other_shape_checkpoint,
        (
            "checkpoint-00000001 was written by a model of another shape: ",
            ", 32) there but (",
            ", 64) in this model",
            "start a new run without --output.resume",
        ),
    ),
    Case(
        "output-read-only",
        _read_only_output,
        ("/mnt is not a writable folder (read-only file system)", "choose a writable --output.dir"),
        _read_only_mount,
    ),
    # preference pairs (training.objective dpo / orpo / simpo)
    Case(
        "pairs-with-objective-sft",
        _file("pairs.jsonl", json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"),
        (
            "pairs.jsonl: preference pairs (columns 'chosen' and 'rejected'), but "
            "training.objective=sft",
            "set --training.objective dpo",
        ),
    ),
    Case(
        "dpo-on-text-data",
        ["--training.objective", "dpo"],
        (
            "training.objective=dpo needs preference pairs: columns 'prompt', 'chosen' and "
            "'rejected'",
            "rename the columns",
        ),
    ),
    Case(
        "pairs-response-not-text",
        lambda tmp, md: (
            _file("pairs.jsonl", json.dumps({"prompt": "a", "chosen": 3, "rejected": "c"}) + "\n")(
                tmp, md
            )
            + ["--training.objective", "dpo", "--data.val_fraction", "0"]
        ),
        (
            "pairs.jsonl:1: 'chosen' must be text or a list of chat messages, got int",
            "check the 'chosen' column",
        ),
    ),
    Case(
        "pairs-bad-chat-role",
        lambda tmp, md: (
            _file(
                "pairs.jsonl",
                json.dumps(
                    {"prompt": "a", "chosen": [{"role": "bot", "content": "x"}], "rejected": "c"}
                )
                + "\n",
            )(tmp, md)
            + ["--training.objective", "dpo"]
        ),
        ("pairs.jsonl:1, 'chosen': chat message 1 has unknown role 'bot'", "rename e.g. 'bot'"),
    ),
    Case(
        "pairs-missing-rejected-names-line",
        _pairs_line5_without_rejected,
        (
            "pairs.jsonl:5: the record has no 'rejected'",
            "give every preference record a 'rejected'",
        ),
        absent=("record 15",),
    ),
    Case(
        "shared-prompt-on-where-it-cannot",
        lambda tmp, md: (
            _file(
                "pairs.jsonl",
                "".join(
                    json.dumps({"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"}) + "\n"
                    for i in range(20)
                ),
            )(tmp, md)
            + ["--training.objective", "reward", "--techniques.shared_prompt", "on"]
            + ["--techniques.compile", "default", "--techniques.compile_regional", "false"]
        ),
        ("techniques.shared_prompt=on, but the model is wrapped or compiled whole", "or off"),
    ),
    Case(
        "split-digits-without-a-trained-tokenizer",
        ["--model.split_digits", "true"],
        ("model.split_digits applies only to the tokenizer trained for a preset model", "drop"),
    ),
    Case(
        "reference-adapters-without-lora",
        ["--training.objective", "dpo", "--preference.reference", "adapters"],
        ("preference.reference=adapters needs LoRA", "--techniques.lora.enabled true"),
    ),
    Case(
        "reference-for-simpo",
        ["--training.objective", "simpo", "--preference.reference", "copy"],
        ("training.objective=simpo uses no reference model", "drop preference.reference"),
    ),
    Case(
        "preference-beta-negative",
        ["--training.objective", "dpo", "--preference.beta", "-0.1"],
        ("preference.beta must be positive, got -0.1", "set preference.beta to e.g. 0.1"),
    ),
    # optional libraries
    Case(
        "bnb-not-installed",
        ["--techniques.optimizer", "adamw-8bit"],
        (
            "bitsandbytes (for techniques.optimizer=adamw-8bit / paged-adamw-8bit) is not "
            "installed",
            "pip install 'onegpu[bnb]'",
        ),
        _bitsandbytes(None),
    ),
    Case(
        "bnb-installed-but-broken",
        ["--techniques.optimizer", "adamw-8bit"],
        (
            "bitsandbytes (for techniques.optimizer=adamw-8bit / paged-adamw-8bit) is installed "
            "but fails to import: ModuleNotFoundError: No module named "
            "'onegpu_missing_cuda_runtime'",
            "repair it",
        ),
        _bitsandbytes("import onegpu_missing_cuda_runtime\n"),
    ),
]


def base_args(tmp, model_dir) -> list[str]:
    data = write_data(tmp, n=40)
    return [
        "train",
        "--model.name",
        str(model_dir),
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--data.num_proc",
        "1",
        "--training.micro_batch_size",
        "2",
        "--training.max_steps",
        "2",
        "--training.eval_every",
        "0",
        "--output.dir",
        str(tmp / "runs"),
        "--output.name",
        "run",
        "--output.report_to",
        "none",
    ]


def _snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, tiny_model_dir, capsys, monkeypatch):
    check_case(
        case, base_args(tmp_path, tiny_model_dir), tmp_path, tiny_model_dir, capsys, monkeypatch
    )


def check_case(case, args, tmp_path, model_dir, capsys, monkeypatch) -> None:
    """Run one catalogue case on top of ``args``: one error with its text and fix, exit code 2, no
    traceback, nothing written."""
    args = args + (case.args(tmp_path, model_dir) if callable(case.args) else case.args)
    if case.patch:
        case.patch(monkeypatch, tmp_path)
    before = _snapshot(tmp_path / "runs")
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    for expect in (case.expect,) if isinstance(case.expect, str) else case.expect:
        assert expect in err, err
    assert (
        "Traceback" not in err
        and err.count("error: ") == 1
        and ("\n" + err).count("\nerror: ") == 1
    )
    assert " at at " not in err and "<class " not in err
    assert not [a for a in case.absent if a in err], err
    assert _snapshot(tmp_path / "runs") == before  # no run directory, no partial files


def test_catalogue_is_big_enough_and_documented():
    from pathlib import Path

    assert len(CASES) >= 30
    doc = (Path(__file__).parents[1] / "docs" / "guarantees.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in doc]
    assert not missing, f"add these cases to docs/guarantees.md: {missing}"


def test_debug_shows_the_traceback(tmp_path, tiny_model_dir, capsys):
    code = main(
        base_args(tmp_path, tiny_model_dir) + ["--training.micro_batch_size", "0", "--debug"]
    )
    assert code == 2 and "Traceback" in capsys.readouterr().err


def test_debug_keeps_its_verbosity_through_train(tmp_path, tiny_model_dir):
    """`onegpu --debug train` sets up logging once, verbosely: the train command does not reset
    it."""
    import logging

    from onegpu.logs import QUIET

    names = ["", *QUIET, "datasets"]
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        assert (
            main(["--debug"] + base_args(tmp_path, tiny_model_dir) + ["--training.max_steps", "1"])
            == 0
        )
        assert logging.getLogger().level == logging.DEBUG
        # ERROR without --debug (datasets sets its own level when it is first imported)
        assert all(logging.getLogger(n).level == logging.INFO for n in QUIET if n != "datasets")
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


def test_secrets_never_reach_saved_configs_or_logs(tmp_path, tiny_model_dir, monkeypatch, capsys):
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123"
    monkeypatch.setenv("HF_TOKEN", token)
    data = write_data(tmp_path, n=40)
    # the token's value inside a saved field (here: a path naming it) is blanked in every saved
    # config
    code = main(
        base_args(tmp_path, tiny_model_dir)
        + [
            "--data.path",
            str(data),
            "--training.save_every",
            "1",
            "--techniques.nvme_path",
            f"/tmp/{token}",
        ]
    )
    assert code == 0
    run = tmp_path / "runs" / "run"
    texts = [
        p.read_text(errors="ignore")
        for p in run.rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl")
    ]
    captured = capsys.readouterr()
    assert len(texts) >= 3 and all(token not in t for t in texts + [captured.out, captured.err])
    assert "nvme_path: /tmp/<redacted>" in (run / "config.yaml").read_text()
    from onegpu.config import redact

    assert redact({"model": {"name": f"x/{token}"}, "k": f"sk-{'a' * 24}"}) == {
        "model": {"name": "x/<redacted>"},
        "k": "<redacted>",
    }
    shutil.rmtree(run)


def test_summary_after_resume_counts_this_process(tmp_path, tiny_model_dir, capsys):
    """summary-after-resume-counts-this-process (docs/guarantees.md)."""
    from helpers import make_cfg
    from onegpu import train

    cfg = make_cfg(tmp_path, tiny_model_dir, max_steps=6, save_every=3, eval_every=0)
    first = train(cfg)
    at_3 = json.loads((first.run_dir / "checkpoint-00000003" / "state.json").read_text())[
        "tokens_seen"
    ]
    cfg["output"]["resume"] = str(first.run_dir / "checkpoint-00000003")
    capsys.readouterr()
    second = train(cfg)
    out = capsys.readouterr().out
    here = second.state.tokens_seen - at_3
    assert (
        second.state.tokens_seen == first.state.tokens_seen and 0 < here < second.state.tokens_seen
    )
    assert second.state.timed_tokens == here  # the speed is this process's tokens over its own time
    expect = f"done: 6 steps (resumed at step 3: 3 steps here), {here:,} tokens trained in "
    assert expect in out, out
    assert f"{first.state.tokens_seen:,} tokens" not in out


def test_chat_turn_trains_content_and_end_token(tiny_tokenizer):
    """chat-turn-trains-content-and-end-token (docs/guarantees.md): with a ChatML-like template
    (a newline after each turn's end), the targets are each reply and its EOS, nothing else."""
    import copy

    import datasets

    from onegpu.config import DataConfig
    from onegpu.data import batches

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    ex = batches.tokenize_counted(
        datasets.Dataset.from_dict({"messages": [conv]}),
        "messages",
        tok,
        DataConfig(seq_len=128, num_proc=1),
    )[0][0]
    targets = [t for t, lab in zip(ex["input_ids"], ex["labels"], strict=True) if lab != -100]
    assert tok.decode(targets) == "hi there<|eos|>see you<|eos|>"
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    ids = ex["input_ids"]
    eos_then_newline = [
        i
        for i in range(len(ids) - 1)
        if ids[i] == tok.eos_token_id and ids[i + 1 : i + 1 + len(newline)] == newline
    ]
    assert len(eos_then_newline) == 4  # the template wrote the newlines; none is a target
