"""A synthetic copy task, the first stage of a copying model (examples/copy/): each task shows a
few lines of standard-library code drawn at random from different functions, in a random order,
and the answer is the same lines unchanged.

Why this and not real functions: a small model shown a real function can lower its loss on the
answer from what it has learned of code (and memorises a few hundred functions outright); lines
drawn at random cannot be predicted from anything but the prompt, so the only way to lower the
loss is to look back and copy — an induction head. A 4-layer model forms one in ~150 steps of
short random strings (benchmarks/results/spec-copy-model-cpu.md); lines of code keep the
tokens those of the edit tasks (data/edits.py), which stage 2 then trains on. The prompt has the
edit tasks' form (EditTask.prompt), so the copying carries over.
"""

from __future__ import annotations

import random

from onegpu.data.edits import EditTask, Split, files_of_split, functions_of
from onegpu.errors import DataError

INSTRUCTION = "copy the code unchanged."


def copy_tasks(
    split: Split,
    count: int,
    seed: int = 0,
    min_chars: int = 80,
    max_chars: int = 240,
    max_bytes: int = 6_000_000,
    val_fraction: float = 0.05,
) -> list[EditTask]:
    """``count`` copy tasks of the split (its files as in data/edits.py): lines drawn at random
    from all the split's functions (blank lines left out) until the text holds at least
    ``min_chars`` characters, at most ``max_chars``."""
    lines = sorted(
        {
            line
            for path in files_of_split(split, max_bytes, val_fraction)
            for _, code in functions_of(path, 20, 4000)
            for line in code.splitlines()
            if line.strip() and len(line) < max_chars
        }
    )
    if not lines:
        raise DataError(
            f"copy tasks: no lines of code in the {split} files.", hint="raise data.max_bytes"
        )
    rng = random.Random(f"copy:{seed}:{split}")
    tasks = []
    while len(tasks) < count:
        picked: list[str] = []
        while sum(len(x) + 1 for x in picked) < min_chars:
            line = rng.choice(lines)
            if sum(len(x) + 1 for x in picked) + len(line) + 1 > max_chars:
                break
            picked.append(line)
        if picked:
            code = "\n".join(picked) + "\n"
            tasks.append(EditTask("copy", f"{split}:random-lines", code, INSTRUCTION, code))
    return tasks
