"""Every file in benchmarks/results/ is cited somewhere (a README, docs/, a code comment, a policy
row), and every results path cited exists: a figure nobody points to is dead weight, and a pointer
to a file that is gone is a claim nobody can check.

A citation is a path under ``results/`` that names a file (an extension), a glob (``name.*``,
``run1-*``) or a folder (a trailing ``/``: the folder's README.md). A record is cited as a whole:
``name.md`` cited covers ``name.json`` and ``name.png`` beside it. A results folder's README.md
indexes its own files by name."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# where citations live: the docs, the code and its comments, the tests, the scripts
SOURCES = ("README.md", "benchmarks/*.md", "benchmarks/*.py", "docs/**/*.md", "src/**/*.py")
SOURCES += ("tests/**/*.py", "scripts/*", "pyproject.toml", "Makefile")
CITE = re.compile(r"results/([A-Za-z0-9_.*/-]*)([^A-Za-z0-9_.*/-]|$)")
TEMPLATE = "<{$"  # results/infer-<device>-<date>.*: a name pattern, not a file
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.*-]*\.[A-Za-z0-9*]+|[A-Za-z0-9_.-]+-\*")


def _is_path(token: str) -> bool:
    last = token.rsplit("/", 1)[-1]
    return token.endswith("/") or "*" in last or "." in last


def repo_citations() -> dict[str, set[str]]:
    """Each cited pattern (relative to benchmarks/results/) and the files that cite it."""
    found: dict[str, set[str]] = {}
    for pattern in SOURCES:
        for path in ROOT.glob(pattern):
            skip = RESULTS in path.parents or path == Path(__file__) or ".venv" in path.parts
            if skip or not path.is_file():
                continue
            for m in CITE.finditer(path.read_text(errors="replace")):
                token, after = m.group(1).rstrip("."), m.group(2)
                if after in TEMPLATE or not token or not _is_path(token):
                    continue
                found.setdefault(token, set()).add(str(path.relative_to(ROOT)))
    return found


def folder_citations() -> set[str]:
    """The names each results folder's README.md gives of its own files."""
    out = set()
    for index in RESULTS.glob("*/README.md"):
        folder = index.parent.relative_to(RESULTS).as_posix()
        out |= {f"{folder}/{n}" for n in NAME.findall(index.read_text())}
    return out


def _matches(pattern: str, rel: str) -> bool:
    if pattern.endswith("/"):
        return rel == pattern + "README.md"
    return fnmatch.fnmatchcase(rel, pattern)


def _record(rel: str) -> str:
    """name.md, name.json, name.png: one record."""
    return re.sub(r"\.(md|json|png)$", "", rel)


def results_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def uncited() -> list[str]:
    patterns = set(repo_citations()) | folder_citations()
    files = results_files()
    cited = {f for f in files if any(_matches(p, f) for p in patterns)}
    records = {_record(f) for f in cited}
    return [f for f in files if f not in cited and _record(f) not in records]


def test_every_results_file_is_cited():
    left = uncited()
    assert not left, (
        f"{len(left)} results file(s) cited nowhere: {left[:10]}. Cite each where its figure is "
        "used (README.md, benchmarks/README.md, docs/, a code comment), or delete it: git "
        "history keeps it"
    )


def test_every_cited_results_path_exists():
    files = results_files()
    missing = {
        pattern: sorted(where)
        for pattern, where in repo_citations().items()
        if not any(_matches(pattern, f) for f in files)
    }
    assert not missing, f"cited results that do not exist (pattern: citing files): {missing}"


def test_the_rules_see_a_missing_and_an_uncited_file(tmp_path):
    """The checks can fail: a template is no citation, a glob and a folder are."""
    text = "see results/gone.md and results/infer-<device>.*, results/x-*, results/h/ and results"
    tokens = [m.group(1) for m in CITE.finditer(text) if m.group(2) not in TEMPLATE]
    assert [t for t in tokens if _is_path(t)] == ["gone.md", "x-*", "h/"]
    assert _matches("h/", "h/README.md") and not _matches("h/", "h/run1.log")
    assert _matches("x-*", "x-cpu.md") and _record("a/b.json") == _record("a/b.md")
