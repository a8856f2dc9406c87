"""Every relative link in README.md, benchmarks/README.md and docs/ points at a file that exists,
and a link to a heading (``page.md#heading``) at a heading that page has: the README sends a
newcomer to docs/ for the detail, so a moved section must not leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "benchmarks/README.md",
    *sorted(p.as_posix() for p in Path(ROOT, "docs").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def broken_links(page: Path) -> list[str]:
    out = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target} (no such heading)")
    return out


def test_every_relative_link_in_the_docs_resolves():
    dead = {p: b for p in PAGES if (b := broken_links(ROOT / p))}
    assert not dead, f"dead links (page: targets): {dead}"


def test_the_check_sees_a_dead_file_and_a_dead_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#its-part) [gone](c.md) [bad](a.md#nope) [web](https://x.y/z)\n")
    assert broken_links(page) == ["c.md (no such file)", "a.md#nope (no such heading)"]
    assert slug("Training methods (the guide's table, as switches)") == (
        "training-methods-the-guides-table-as-switches"
    )
