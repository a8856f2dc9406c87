"""The one results header: what ran, where, from which commit, at what load."""

from __future__ import annotations

import subprocess

from onegpu.bench import provenance


def test_the_header_names_command_commit_date_machine_and_load_before_and_after():
    head = provenance.begin("python benchmarks/x.py --rounds 5")
    done = provenance.end(head)
    assert done["command"] == "python benchmarks/x.py --rounds 5"
    head_commit = subprocess.run(
        ["git", "-C", str(provenance.ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert done["commit"].removesuffix("+local") == head_commit
    assert done["date"].endswith("UTC") and done["machine"]["cpus"] >= 1
    assert "load average" in done["uptime_before"] and "load average" in done["uptime_after"]
    md = provenance.markdown(done)
    assert md.startswith("`python benchmarks/x.py --rounds 5`")
    for part in (done["commit"], done["date"], done["uptime_before"], done["uptime_after"]):
        assert part in md


def test_a_tree_outside_git_reads_unknown(tmp_path):
    assert provenance.commit(tmp_path) == "unknown"
