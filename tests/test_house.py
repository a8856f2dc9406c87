"""Rules of the house, checked on the source: no import cycles (module-level or inside functions),
no module over ~400 lines, one pipeline applying the methods; and the fast test tier's guard."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "onegpu"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> onegpu modules it imports anywhere in its code (lazy imports included)."""
    mods = _modules()

    def owner(name: str) -> str | None:  # the module a dotted import name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.startswith("onegpu") else None
                if (
                    target and target != mod and not mod.startswith(target + ".")
                ):  # a package's own parent: fine
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    assert "onegpu.training.run" in graph and graph["onegpu.plan.probe"]  # the graph is really read
    assert cycles(graph) == []


def test_training_does_not_import_the_planner():
    """Plan before train: the API layer (onegpu.train) calls the planner, the loop never does."""
    graph = import_graph()
    training = [m for m in graph if m.startswith("onegpu.training")]
    assert not {t for m in training for t in graph[m] if t.startswith("onegpu.plan")}


def test_no_module_over_the_size_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_methods_are_applied_only_by_the_pipeline():
    """apply_lora / apply_checkpointing / apply_compile / apply_moe_aux_loss are called from
    techniques/prepare.py only: training, planner and benchmarks all go through prepare_model."""
    callers = _callers({"apply_lora", "apply_checkpointing", "apply_compile", "apply_moe_aux_loss"})
    assert callers and all(mods == {"onegpu.techniques.prepare"} for mods in callers.values()), (
        callers
    )


# Who may build what: one assembly (training/assemble.assemble) builds models, objectives and
# accelerators for training and every planner path. The HF peers of the benchmark load their model
# themselves: they are the comparison, built as HF builds it, not a second assembly of ours.
ASSEMBLY = "onegpu.training.assemble"
ONLY = {
    "prepare_model": {ASSEMBLY},
    "load_model": {ASSEMBLY, "onegpu.bench.train_peers"},
    "Accelerator": {ASSEMBLY},
    "_reset_state": {ASSEMBLY},  # Accelerate's private reset: one place, with the reason beside it
    "make_objective": {ASSEMBLY},
    "accelerator.prepare": {"onegpu.distributed"},  # distributed.prepare: the FSDP2-aware wrapper
    "distributed.prepare": {ASSEMBLY},
}
OBJECTIVES = {"SFT", "Preference", "AdapterReference", "CopyReference", "FixedReference"}


def _call_name(node: ast.Call) -> set[str]:
    """The names a call is known by: ``f(...)`` -> f; ``x.f(...)`` -> f and (a plain name x) x.f."""
    func = node.func
    if isinstance(func, ast.Name):
        return {func.id}
    if isinstance(func, ast.Attribute):
        names = {func.attr}
        if isinstance(func.value, ast.Name):
            names.add(f"{func.value.id}.{func.attr}")
        return names
    return set()


def _callers(names: set[str]) -> dict[str, set[str]]:
    callers: dict[str, set[str]] = {}
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                for name in _call_name(node) & names:
                    callers.setdefault(name, set()).add(mod)
    return callers


def test_call_finder_sees_calls_and_methods():
    call = ast.parse("accelerator.prepare(m, o)").body[0].value
    assert _call_name(call) == {"prepare", "accelerator.prepare"}


def test_one_assembly():
    """Models are loaded and prepared, accelerators made and prepared, and objectives chosen in
    training/assemble.py only; objectives are constructed in objectives/ only (make_objective)."""
    callers = _callers(set(ONLY))
    assert set(callers) == set(ONLY), (
        callers
    )  # each is really called somewhere: the scan reads calls
    wrong = {name: mods - ONLY[name] for name, mods in callers.items() if mods - ONLY[name]}
    assert wrong == {}
    built = {m for mods in _callers(OBJECTIVES).values() for m in mods}
    assert built and all(m.startswith("onegpu.objectives") for m in built), built


def test_the_planner_assembles_through_training():
    """Training and every planner path (probes, accuracy check, activation measurement) use the one
    assembly (test_one_assembly: none of them builds a model, objective or accelerator itself)."""
    users = {m for m, targets in import_graph().items() if ASSEMBLY in targets}
    assert {
        "onegpu.plan.activations",
        "onegpu.plan.accuracy",
        "onegpu.plan.probe",
        "onegpu.training.run",
    } <= users


def test_no_getattr_probing_of_the_objective():
    """The step, the loop and evaluation call the Objective protocol; they never probe for it."""
    for name in ("step", "loop", "evaluate", "run", "assemble"):
        text = (SRC / "training" / f"{name}.py").read_text(encoding="utf-8")
        assert "getattr(objective" not in text and "getattr(run.objective" not in text
        assert "loss_fn" not in text, name


COSTLY = """
import time

import pytest


def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_unmarked():
    _burn(0.6)


@pytest.mark.slow
def test_marked():
    _burn(0.6)


def test_cheap():
    pass
"""


def test_the_tier_guard_fails_a_slow_test_left_in_the_fast_tier(pytester):
    """tests/tier_guard.py, at a limit of 0.3 CPU seconds: a test that burns 0.6 fails unless it is
    marked slow; without --tier-guard nothing is judged."""
    pytester.makeini("[pytest]\nfast_tier_limit_s = 0.3\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_costly=COSTLY)
    guarded = pytester.runpytest("-p", "tier_guard", "--tier-guard")
    guarded.assert_outcomes(passed=2, failed=1)
    guarded.stdout.fnmatch_lines(["*test_unmarked took * CPU seconds, over the fast tier's 0.3*"])
    pytester.runpytest("-p", "tier_guard").assert_outcomes(passed=3)


def test_the_tier_guard_backs_cpu_time_with_the_wall_clock():
    """A test that waits on work it does not pay for (a live server's) costs wall time only."""
    from tier_guard import WALL_FACTOR, over_limit

    assert over_limit(5.0, 30.0, 20.0) is None
    assert "CPU seconds" in over_limit(21.0, 22.0, 20.0)
    assert "wall clock" in over_limit(1.0, WALL_FACTOR * 20.0 + 1, 20.0)
