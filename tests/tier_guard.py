"""The fast tier's guard: a test that costs more than the tier's limit fails unless it is marked
``slow`` (``make test`` leaves those to ``make test-all``).

What is measured is CPU seconds, not the wall clock: the test process's own (every thread) plus
those of the child processes it waited for during its setup and call. A shared or noisy machine
stretches the wall clock of every test, not the CPU time each one needs, so the verdict is the
same on a quiet machine and a busy one. Children reaped in a teardown (a module's server) are not
charged to the test that happens to run last. A test that mostly waits on a process it does not
reap (a live server does the work) costs little CPU here; the wall clock catches those, at a wider
limit (WALL_FACTOR) so that a loaded machine does not trip it.

On when asked (``--tier-guard``, which the Makefile's tiers and CI pass), so that a one-off
``pytest`` on a developer's machine with other work running is never failed for its speed. The
limit is the ini option ``fast_tier_limit_s`` (pyproject.toml).
"""

from __future__ import annotations

import os
import time

import pytest

WALL_FACTOR = 3.0  # the wall-clock backstop: this many times the CPU limit


def pytest_addoption(parser):
    parser.addoption(
        "--tier-guard",
        action="store_true",
        default=False,
        help="fail a test not marked slow that costs more than fast_tier_limit_s CPU seconds",
    )
    parser.addini("fast_tier_limit_s", "CPU seconds a test of the fast tier may take", default="20")


def pytest_sessionstart(session):
    """With the guard on, each process (an xdist worker included) pays inductor's one-time start —
    its imports, the C++ toolchain's checks, a first kernel built — here, before any test: charged
    to a test, it went to whichever compiling test a worker happened to run first (8 CPU seconds
    and more from a cold cache), not to the test's own work."""
    if not session.config.getoption("--tier-guard"):
        return
    import torch

    torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(8))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _Cost:
    def __init__(self):
        self.cpu = 0.0
        self.wall = 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._tier_cost = cost = _Cost()
    cpu, wall = _cpu(), time.perf_counter()
    yield
    cost.cpu += _cpu() - cpu
    cost.wall += time.perf_counter() - wall


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    cpu, wall = _cpu(), time.perf_counter()
    yield
    cost = getattr(item, "_tier_cost", None)
    if cost is not None:
        cost.cpu += _cpu() - cpu
        cost.wall += time.perf_counter() - wall


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or not item.config.getoption("--tier-guard"):
        return
    if item.get_closest_marker("slow") is not None:
        return
    cost = getattr(item, "_tier_cost", None)
    limit = float(item.config.getini("fast_tier_limit_s"))
    if cost is not None:
        # into the JUnit file (with the teardown report): the tier's report lists the fast tests
        # nearest the limit
        item.user_properties.append(("cpu_s", f"{cost.cpu:.2f}"))
    verdict = over_limit(cost.cpu, cost.wall, limit) if cost is not None else None
    if verdict:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} {verdict}: it belongs to the slow tier. Mark it "
            "@pytest.mark.slow (make test-all still runs it), or make it cheaper."
        )


def over_limit(cpu: float, wall: float, limit: float) -> str | None:
    """Why a test of these costs is too slow for the fast tier, or None."""
    if cpu > limit:
        return f"took {cpu:.1f} CPU seconds, over the fast tier's {limit:g}"
    if wall > WALL_FACTOR * limit:
        return f"took {wall:.1f} s of wall clock, over {WALL_FACTOR:g} x the fast tier's {limit:g}"
    return None
