"""The headline of `onegpu bench train`'s report: each pairing of our arms with a peer trainer,
saying which side compiled and what each side's start-up (compiling included) cost."""

from __future__ import annotations

from onegpu.bench.timing import fmt as _fmt


def compiled(arm: dict) -> bool | None:
    """Whether the arm's code was compiled, read off its live objects (the evidence)."""
    ev = next((r.get("evidence") for r in arm.get("reps", []) if r.get("evidence")), None)
    return None if ev is None or "compiled" not in ev else bool(ev["compiled"])


def side(arm: dict) -> str:
    """'compiled' or 'eager', as the headline says it."""
    return {True: "compiled", False: "eager", None: "compile unknown"}[compiled(arm)]


def headline(doc: dict, peers: dict) -> list[str]:
    """One line per pairing with a peer: the ratios, which side compiled, and each side's start-up
    seconds (compiling included) beside the steady tokens/s the ratio compares. ``peers``:
    train_report.PEERS."""
    lines = []
    for key, (ref, label, _ours) in peers.items():
        peer = doc["arms"].get(ref, {})
        for name, vs in doc.get(key, {}).items():
            ours = doc["arms"][name]
            unlike = compiled(ours) is not None and compiled(ours) != compiled(peer)
            lines.append(
                f"- **onegpu `{name}` ({side(ours)}) vs {label} ({side(peer)}): "
                f"{_fmt(vs['speed_x'], '.2f', 'x')} tokens/s, "
                f"{_fmt(vs['memory_x'], '.2f', 'x')} memory.** Start-up "
                f"{_fmt(ours.get('startup_s'), '.0f', ' s')} vs "
                f"{_fmt(peer.get('startup_s'), '.0f', ' s')}"
                + ("; not like for like: only one side compiled." if unlike else ".")
            )
    return lines + ([""] if lines else [])


def compile_note(doc: dict) -> str:
    """How compile=auto was settled for our arms on this device (bench.arms.settle_compile)."""
    steps = doc["config"]["training"]["max_steps"]
    if doc["device"]["type"] == "cuda":
        return (
            "Compile: on a GPU our arms run as a default run of 50+ steps does (compile=auto "
            "compiles there), though this one has "
            f"{steps}; compiling falls in the untimed first steps and shows as start-up seconds."
        )
    return (
        f"Compile: on a CPU compile=auto decides by the run's own length ({steps} steps: "
        + (
            "compiled where a C++ compiler exists"
            if steps >= 50
            else "eager, as `onegpu train` runs under 50 steps"
        )
        + "); the `compile` arm shows what compiling adds."
    )
