"""The header of every results file: the command that made it, the commit, the date, the machine
and its load (`uptime`) before and after. One writer, so that every file in benchmarks/results/
can be traced back and judged the same way on a shared machine."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[3]  # the checkout: src/onegpu/bench/ -> ../../..


def uptime() -> str:
    """``uptime``'s line (its load averages), or "" where there is no such command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def commit(path: Path = ROOT) -> str:
    """The short commit of the checkout at ``path``, "+local" when its tree has changes; "unknown"
    outside a git checkout. A run from a copy of src/ (benchmarks/bench_train.py --snapshot) is
    named by the commit the copy was taken from, in ONEGPU_BENCH_COMMIT."""
    if os.environ.get("ONEGPU_BENCH_COMMIT"):
        return os.environ["ONEGPU_BENCH_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+local" if dirty else "")) if head else "unknown"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def versions(packages: tuple[str, ...], missing: bool = True) -> dict:
    """Python's version and each installed package's (None for one not installed, or left out when
    ``missing`` is False)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict = {"python": platform.python_version()}
    for pkg in packages:
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            if missing:
                found[pkg] = None
    return found


def machine() -> dict:
    """What ran it: platform, CPU model and count, the card if one is visible, library versions."""
    found = {"platform": platform.platform(), "cpu": cpu_name(), "cpus": os.cpu_count()}
    found["python"] = platform.python_version()
    try:
        import torch
        import transformers

        found.update(torch=torch.__version__, transformers=transformers.__version__)
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return found


def begin(command: Optional[str] = None, path: Path = ROOT) -> dict:
    """The header's fields known before the run (the load before it included). ``command``: how
    to run it again; by default this process's own command line."""
    if command is None:
        script = Path(sys.argv[0])
        try:
            script = script.resolve().relative_to(ROOT)
        except ValueError:
            pass
        command = " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])
    return {
        "command": command,
        "commit": commit(path),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "uptime_before": uptime(),
    }


def end(header: dict) -> dict:
    """The header with the load after the run."""
    return {**header, "uptime_after": uptime()}


def markdown(header: dict) -> str:
    """The lines every results page starts with (after its title)."""
    m = header.get("machine") or {}
    where = (
        m
        if isinstance(m, str)
        else ", ".join(str(v) for v in (m.get("gpu"), m.get("cpu"), f"{m.get('cpus')} CPUs") if v)
    )
    versions = (
        ""
        if isinstance(m, str)
        else ", ".join(f"{k} {m[k]}" for k in ("torch", "transformers") if k in m)
    )
    return "\n".join(
        [
            f"`{header['command']}`",
            "",
            f"{header['date']}, commit {header['commit']}, {where}"
            + (f", {versions}" if versions else "")
            + f". Load before: `{header.get('uptime_before', '')}`;"
            f" after: `{header.get('uptime_after', '')}`.",
            "",
        ]
    )
