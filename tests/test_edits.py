"""The code-edit workload (data/edits.py): tasks from the standard library's functions, each edit
done right, deterministic, split by the default job's held-out files; data.corpus=edits trains on
them."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from onegpu.config import from_dict
from onegpu.data import edits
from onegpu.data.records import stdlib_source
from onegpu.errors import ConfigError, DataError
from onegpu.training.data import read_records

SMALL = dict(max_bytes=400_000, val_fraction=0.2)


def test_tasks_are_deterministic_given_the_seed():
    a = edits.edit_tasks("train", 12, seed=3, **SMALL)
    b = edits.edit_tasks("train", 12, seed=3, **SMALL)
    c = edits.edit_tasks("train", 12, seed=4, **SMALL)
    assert a == b and len(a) == 12
    assert [t.origin for t in a] != [t.origin for t in c]


def test_heldout_functions_come_from_the_default_jobs_heldout_files():
    src = stdlib_source(SMALL["max_bytes"], SMALL["val_fraction"])
    root = Path(edits.stdlib_root())
    held = {Path(f).relative_to(root).as_posix() for f in src.val_files}
    train = edits.edit_tasks("train", 40, **SMALL)
    heldout = edits.edit_tasks("heldout", 40, **SMALL)
    assert heldout and {t.origin.split(":")[0] for t in heldout} <= held
    assert not {t.origin.split(":")[0] for t in train} & held
    assert not {t.origin for t in train} & {t.origin for t in heldout}


def test_every_kind_appears_and_every_answer_compiles_and_differs():
    tasks = edits.edit_tasks("train", 60, **SMALL)
    assert {t.kind for t in tasks} == set(edits.KINDS)
    for t in tasks:
        assert 300 <= len(t.code) <= 900
        compile(t.answer, t.origin, "exec")
        assert t.answer != t.code
        assert t.prompt == f"{t.code}\n# Edit: {t.instruction}\n# Result:\n"


CODE = '''def scale(values, factor=2):
    """Scale each value."""
    out = []
    for v in values:
        if v is not None:
            out.append(v * factor)
    return dict(values=out, kind='scaled', note='x')
'''


def _task(kind: str) -> edits.EditTask:
    task = edits.make_task(kind, "m.py:scale", CODE, random.Random(0))
    assert task is not None and task.kind == kind
    return task


def _names(code: str) -> set[str]:
    fn = ast.parse(code).body[0]
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {a.arg for a in fn.args.args}


def test_rename_changes_every_use_of_the_name_and_nothing_else():
    task = _task("rename")
    old, new = task.instruction.split("`")[1], task.instruction.split("`")[3]
    assert old in _names(CODE) and new not in _names(CODE)
    assert old not in _names(task.answer) and new in _names(task.answer)
    # the same tree with the name swapped back: nothing else moved
    assert ast.dump(ast.parse(task.answer.replace(new, old))) == ast.dump(ast.parse(CODE))
    # a keyword argument of a call is not the variable
    rng = random.Random(0)
    code = "def f(values):\n    return dict(values=values)\n"
    while True:
        t = edits.make_task("rename", "m.py:f", code, rng)
        if "`values`" in t.instruction:
            break
    new = t.instruction.split("`")[3]
    assert t.answer == f"def f({new}):\n    return dict(values={new})\n"


def test_add_param_appends_a_none_default_to_the_signature():
    task = _task("add_param")
    new = task.instruction.split("`")[1]
    fn = ast.parse(task.answer).body[0]
    assert [a.arg for a in fn.args.args] == ["values", "factor", new]
    assert isinstance(fn.args.defaults[-1], ast.Constant) and fn.args.defaults[-1].value is None
    assert task.answer.splitlines()[1:] == CODE.splitlines()[1:]
    assert edits.make_task("add_param", "m", "def f(*a):\n    return a\n", random.Random()) is None
    empty = edits.make_task("add_param", "m", "def f():\n    return 1\n", random.Random(0))
    assert empty.answer.startswith(f"def f({empty.instruction.split('`')[1]}=None):")


def test_reindent_halves_each_level_and_keeps_string_text():
    code = 'def f(a):\n    s = """x\n        y"""\n    if a:\n        return s\n'
    task = edits.make_task("reindent", "m", code, random.Random(0))
    assert task.answer == 'def f(a):\n  s = """x\n        y"""\n  if a:\n    return s\n'
    assert ast.dump(ast.parse(task.answer)) == ast.dump(ast.parse(code))


def test_quotes_rewrites_plain_single_quoted_strings_only():
    task = _task("quotes")
    assert 'kind="scaled", note="x"' in task.answer
    code = "def f():\n    return 'it\"s', r'\\d', 'ok'\n"
    t = edits.make_task("quotes", "m", code, random.Random(0))
    assert t.answer == "def f():\n    return 'it\"s', r'\\d', \"ok\"\n"
    assert ast.dump(ast.parse(t.answer)) == ast.dump(ast.parse(code))
    assert edits.make_task("quotes", "m", 'def f():\n    return "a"\n', random.Random()) is None


def test_an_unknown_split_is_one_clear_error():
    with pytest.raises(DataError, match="unknown split 'test'"):
        edits.edit_tasks("test", 1)


def test_data_corpus_edits_gives_the_run_prompt_completion_records():
    cfg = from_dict(
        {
            "data": {"corpus": "edits", **SMALL},
            "training": {"max_steps": 3, "micro_batch_size": 2, "eval_batches": 2, "seed": 5},
        }
    )
    recs = read_records(cfg)
    assert recs.format == "prompt_completion"
    assert len(recs.train) == 3 * 2 and len(recs.val) == 2 * 2
    want = edits.edit_tasks("train", 6, 5, **SMALL)
    assert recs.train[0] == {"prompt": want[0].prompt, "completion": want[0].answer}
    held = {t.prompt for t in edits.edit_tasks("heldout", 4, 5, **SMALL)}
    assert set(recs.val["prompt"]) == held
    cfg.training.objective = "dpo"
    with pytest.raises(ConfigError, match="data.corpus=edits .* training.objective=sft"):
        read_records(cfg)
