"""Code-edit tasks made from the Python standard library's own functions: input-grounded work,
where most of the answer is text the prompt already holds.

Each task is one function (read with ``ast`` from a stdlib module on disk), an instruction and the
edited function: rename a variable through the function, add a parameter, re-indent it with two
spaces, or rewrite its string literals with double quotes. The prompt is the code, then the
instruction; the answer (the completion) is the whole edited function. Every edited function is
checked to compile.

The splits follow the default job's file split (records.stdlib_source): ``train`` tasks come from
its training files, ``heldout`` tasks from the files it holds out, so a held-out function is one
neither the default job's model nor a model trained on the train split has seen. Tasks are
deterministic given the seed and the standard library on disk.
"""

from __future__ import annotations

import ast
import io
import random
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from onegpu.data.records import stdlib_source
from onegpu.errors import ConfigError, DataError

KINDS = ("rename", "add_param", "reindent", "quotes")
Split = Literal["train", "heldout"]
# New names for renames and added parameters: ordinary identifiers that a function's text does not
# predict, so the answer must take them from the instruction
NAMES = (
    "total", "entry", "chunk", "cursor", "handle", "marker", "bucket", "record", "target",
    "payload", "offset_value", "limit_value", "extra", "options", "context", "callback",
    "verbose", "strict", "encoding_name", "timeout_s", "label", "weight", "scale", "level",
)  # fmt: skip


@dataclass(frozen=True)
class EditTask:
    """One edit: the code shown, what to do, and the edited code expected."""

    kind: str
    """rename, add_param, reindent or quotes."""
    origin: str
    """Where the function comes from: "module/path.py:qualified_name"."""
    code: str
    """The function's source, dedented."""
    instruction: str
    """The edit asked for, in words."""
    answer: str
    """The edited function (the completion)."""

    @property
    def prompt(self) -> str:
        return f"{self.code}\n# Edit: {self.instruction}\n# Result:\n"


def edit_tasks(
    split: Split,
    count: int,
    seed: int = 0,
    min_chars: int = 300,
    max_chars: int = 900,
    max_bytes: int = 6_000_000,
    val_fraction: float = 0.05,
) -> list[EditTask]:
    """``count`` tasks of the split, on functions of ``min_chars``..``max_chars`` characters (about
    100-300 tokens of the presets' tokenizer each, so prompt + answer is ~200-600), cycling through
    the functions (in an order shuffled by ``seed``) and the kinds each function allows.
    ``max_bytes`` and ``val_fraction`` are the default job's corpus (data.max_bytes,
    data.val_fraction): its file split is the tasks' split."""
    if split not in ("train", "heldout"):
        raise DataError(f"edit tasks: unknown split '{split}'.", hint="use train or heldout")
    files = files_of_split(split, max_bytes, val_fraction)
    functions = [f for path in files for f in functions_of(path, min_chars, max_chars)]
    if not functions:
        raise DataError(
            f"no standard-library functions of {min_chars}-{max_chars} characters in the "
            f"{split} files.",
            hint="widen min_chars / max_chars, or raise data.max_bytes",
        )
    rng = random.Random(f"{seed}:{split}")
    rng.shuffle(functions)
    tasks: list[EditTask] = []
    for round_ in range(count):  # each pass over the functions starts each at a new kind
        for i, (origin, code) in enumerate(functions):
            kinds = KINDS[(i + round_) % len(KINDS) :] + KINDS[: (i + round_) % len(KINDS)]
            for kind in kinds:
                task = make_task(kind, origin, code, rng)
                if task is not None:
                    tasks.append(task)
                    break
            if len(tasks) == count:
                return tasks
    return tasks


def files_of_split(split: Split, max_bytes: int, val_fraction: float) -> list[Path]:
    """The default job's files of the split (records.stdlib_source)."""
    src = stdlib_source(max_bytes, val_fraction)
    return [Path(p) for p in (src.train_files if split == "train" else src.val_files)]


def functions_of(path: Path, min_chars: int, max_chars: int) -> list[tuple[str, str]]:
    """(origin, dedented source) of the module's functions and methods of the size asked for."""
    text = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    root = Path(stdlib_root())
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    for node, qual in _walk(tree, ""):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        code = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
        if min_chars <= len(code) <= max_chars and "\t" not in code and _compiles(code):
            out.append((f"{rel}:{qual}", code))
    return out


def _walk(tree, prefix: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node, f"{prefix}{node.name}.")


def stdlib_root() -> str:
    import sysconfig

    return sysconfig.get_paths()["stdlib"]


def _compiles(code: str) -> bool:
    try:
        compile(code, "<edit>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def make_task(kind: str, origin: str, code: str, rng: random.Random) -> EditTask | None:
    """The task of that kind on this function, or None where the function does not allow it (no
    local name to rename, no single-quoted string, ...)."""
    made = {"rename": _rename, "add_param": _add_param, "reindent": _reindent, "quotes": _quotes}[
        kind
    ](code, rng)
    if made is None:
        return None
    instruction, answer = made
    if answer == code or not _compiles(answer):
        return None
    return EditTask(kind, origin, code, instruction, answer)


def _rename(code: str, rng: random.Random):
    """Rename one parameter or local variable everywhere in the function."""
    fn = ast.parse(code).body[0]
    args = fn.args
    params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    locals_ = [
        n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    ]
    candidates = sorted({n for n in (*params, *locals_) if n not in ("self", "cls", "_")})
    taken = _identifiers(code)
    fresh = [n for n in NAMES if n not in taken]
    if not candidates or not fresh:
        return None
    old, new = rng.choice(candidates), rng.choice(fresh)
    spots = [
        (n.lineno, n.col_offset)
        for n in ast.walk(fn)
        if (isinstance(n, ast.Name) and n.id == old) or (isinstance(n, ast.arg) and n.arg == old)
    ]
    lines = code.splitlines(keepends=True)
    for line, col in sorted(spots, reverse=True):
        text = lines[line - 1]
        # ast columns count UTF-8 bytes
        raw = text.encode()
        lines[line - 1] = (raw[:col] + new.encode() + raw[col + len(old.encode()) :]).decode()
    return f"rename the variable `{old}` to `{new}`.", "".join(lines)


def _identifiers(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)} | {
        t.string for t in _tokens(code) if t.type == tokenize.NAME
    }


def _tokens(code: str):
    return list(tokenize.generate_tokens(io.StringIO(code).readline))


def _add_param(code: str, rng: random.Random):
    """Add a parameter with a default of None at the end of the signature (functions without
    *args / **kwargs)."""
    fn = ast.parse(code).body[0]
    if fn.args.vararg is not None or fn.args.kwarg is not None:
        return None
    taken = _identifiers(code)
    fresh = [n for n in NAMES if n not in taken]
    if not fresh:
        return None
    new = rng.choice(fresh)
    toks = _tokens(code)
    # the signature's parentheses: the first "(" after the def's name and its match
    start = next(
        i
        for i, t in enumerate(toks)
        if t.type == tokenize.NAME and t.string == fn.name and toks[i - 1].string == "def"
    )
    depth, close = 0, None
    for i in range(start + 1, len(toks)):
        if toks[i].string == "(":
            depth += 1
        elif toks[i].string == ")":
            depth -= 1
            if depth == 0:
                close = i
                break
    if close is None:
        return None
    before = toks[close - 1]
    empty, comma = before.string == "(", before.string == ","
    insert = f"{new}=None" if empty else (f" {new}=None" if comma else f", {new}=None")
    if before.start[0] != toks[close].start[0]:  # ")" on a line of its own
        return None
    line, col = toks[close].start
    lines = code.splitlines(keepends=True)
    at = before.end[1] if not empty else col
    lines[line - 1] = lines[line - 1][:at] + insert + lines[line - 1][at:]
    return f"add a parameter `{new}` with the default None at the end of the signature.", "".join(
        lines
    )


def _reindent(code: str, rng: random.Random):
    """Indent with two spaces per level instead of four (continuation lines keep their offset
    beyond the indent levels)."""
    out = []
    strings = _string_lines(code)
    for n, line in enumerate(code.splitlines(keepends=True), 1):
        lead = len(line) - len(line.lstrip(" "))
        out.append(line if n in strings else " " * (lead // 4 * 2 + lead % 4) + line[lead:])
    return "re-indent the function with two spaces per level.", "".join(out)


def _string_lines(code: str) -> set[int]:
    """Lines inside a multi-line string after its first: their spaces are the string's text."""
    return {
        n
        for t in _tokens(code)
        if t.type == tokenize.STRING and t.end[0] > t.start[0]
        for n in range(t.start[0] + 1, t.end[0] + 1)
    }


def _quotes(code: str, rng: random.Random):
    """Single-quoted string literals (no prefix, no quote or backslash inside) with double
    quotes."""
    lines = code.splitlines(keepends=True)
    done = 0
    for t in reversed(_tokens(code)):
        s = t.string
        if t.type != tokenize.STRING or len(s) < 2 or s[0] != "'" or s.startswith("'''"):
            continue
        if '"' in s or "\\" in s or t.start[0] != t.end[0]:
            continue
        line, col = t.start
        text = lines[line - 1]
        lines[line - 1] = text[:col] + '"' + s[1:-1] + '"' + text[t.end[1] :]
        done += 1
    if not done:
        return None
    return "rewrite the single-quoted strings with double quotes.", "".join(lines)


def edit_records(d, t, make=edit_tasks) -> tuple:
    """data.corpus=edits: the code-edit tasks (data/edits.py), data.corpus=copy: the copy task
    (data/copy_task.py), as prompt/completion records, as
    many training tasks as the run's steps take and a validation batch per evaluation batch:
    (train, validation or None, fingerprint). ``d``, ``t``: the run's DataConfig and
    TrainingConfig; ``make``: the task builder (edit_tasks, copy_task.copy_tasks)."""
    import datasets

    if t.objective != "sft":
        raise ConfigError(
            f"data.corpus={d.corpus} gives prompt/completion records, for "
            f"training.objective=sft; got {t.objective}.",
            hint="set --training.objective sft, or data.corpus stdlib",
        )
    count = t.max_steps * t.micro_batch_size * t.grad_accum
    kw = dict(
        min_chars=d.edit_max_chars // 3,
        max_chars=d.edit_max_chars,
        max_bytes=d.max_bytes,
        val_fraction=d.val_fraction,
    )
    splits = [make("train", count, t.seed, **kw)]
    if d.val_fraction > 0:
        n_val = max(t.eval_batches, 1) * t.micro_batch_size
        splits.append(make("heldout", n_val, t.seed, **kw))
    recs = [
        datasets.Dataset.from_list(
            [{d.prompt_field: e.prompt, d.completion_field: e.answer} for e in tasks]
        )
        for tasks in splits
    ]
    finger = f"{d.corpus}:{d.max_bytes}:{d.val_fraction}:{d.edit_max_chars}:{t.seed}:{count}"
    return recs[0], recs[1] if len(recs) > 1 else None, finger
