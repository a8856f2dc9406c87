"""The synthetic copy task (data/copy_task.py): lines of code drawn at random, answered unchanged,
in the edit tasks' prompt form, split by the default job's files; data.corpus=copy trains on it."""

from __future__ import annotations

from onegpu.config import from_dict
from onegpu.data import copy_task, edits
from onegpu.training.data import read_records

SMALL = dict(max_bytes=400_000, val_fraction=0.2)


def test_each_task_is_its_lines_copied_within_the_size_asked_for():
    tasks = copy_task.copy_tasks("train", 20, seed=1, min_chars=40, max_chars=120, **SMALL)
    assert len(tasks) == 20
    for t in tasks:
        assert t.kind == "copy" and t.answer == t.code
        assert len(t.code) <= 120 and t.code.endswith("\n")
        assert t.prompt == f"{t.code}\n# Edit: {copy_task.INSTRUCTION}\n# Result:\n"
    # drawn at random: no two tasks alike (a model cannot learn them by heart)
    assert len({t.code for t in tasks}) == 20


def test_tasks_are_deterministic_and_the_splits_draw_from_their_own_files():
    a = copy_task.copy_tasks("train", 8, seed=3, **SMALL)
    assert a == copy_task.copy_tasks("train", 8, seed=3, **SMALL)
    assert a != copy_task.copy_tasks("train", 8, seed=4, **SMALL)
    held = copy_task.copy_tasks("heldout", 30, seed=3, **SMALL)
    train_lines = {
        line
        for path in edits.files_of_split("train", **SMALL)
        for _, code in edits.functions_of(path, 20, 4000)
        for line in code.splitlines()
    }
    held_lines = [line for t in held for line in t.code.splitlines()]
    # lines common to both splits (`return None`) aside, held-out text is the held-out files'
    assert sum(line not in train_lines for line in held_lines) > len(held_lines) / 2


def test_data_corpus_copy_gives_the_run_prompt_completion_records():
    cfg = from_dict(
        {
            "data": {"corpus": "copy", "edit_max_chars": 120, **SMALL},
            "training": {"max_steps": 3, "micro_batch_size": 2, "eval_batches": 1, "seed": 5},
        }
    )
    recs = read_records(cfg)
    assert recs.format == "prompt_completion"
    assert len(recs.train) == 3 * 2 and len(recs.val) == 2
    want = copy_task.copy_tasks("train", 6, 5, min_chars=40, max_chars=120, **SMALL)
    assert recs.train[0] == {"prompt": want[0].prompt, "completion": want[0].answer}
    assert recs.fingerprint.startswith("copy:")
