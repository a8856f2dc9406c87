"""The engine's per-device choices, in one table: what each does, its setting, the results file
that justifies it and the model shapes it was measured on. Every row can be switched off
(``EngineConfig.policy_off``: the names of the rows to leave out), and a row whose gain does not
hold on a second shape is not in the table.

The CPU rows were measured on the ``tiny`` and ``125m`` presets
(``benchmarks/results/engine-policy-cpu.md``, ``benchmarks/policy_ab.py``); the CUDA rows on
the ``1b`` preset on an H200, and are to be measured on an 8B shape on the next card
(``scripts/gpu_check.sh policy``). Three CPU rows timed on ``tiny`` alone before went when the
``125m`` shape did not gain from them (the same file): inductor's realize threshold for the
query, the frozen step (weights folded in, C++ GEMM templates, a C++ wrapper: 8% slower at
``125m``) and skipping a warm bucket's guards. A row of device "any" applies on every device:
``batched_lora`` (a compiled step with adapters at all, a CUDA graph on a GPU) was measured on
the CPU shapes (``benchmarks/lora_batched.py``) and is to be timed on the next card.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Rule:
    device: str
    what: str
    results: str
    shapes: tuple[str, ...]


RULES: dict[str, Rule] = {
    "cpu_attention_loops": Rule(
        "cpu",
        "a compiled decode step attends in inductor's loops over the blocks where they lie "
        "(cpu_attention.py), not SDPA's kernel over a gathered copy (at every row count: from 2 "
        "rows over the slot cache's views, from 1 over the paged pool)",
        "benchmarks/results/engine-policy-cpu.md",
        ("tiny", "125m"),
    ),
    "eager_window": Rule(
        "cpu",
        "an eager decode run reads a copy of its rows' blocks, gathered at its first step and "
        "kept up to date by each (paged_cache.Window), not a gather at every step",
        "benchmarks/results/engine-policy-cpu.md",
        ("tiny", "125m"),
    ),
    "batched_lora": Rule(
        "any",
        "a decode run whose rows name LoRA adapters adds each row's adapter as batched matmuls "
        "over the adapters' stacked weights, indexed by row (batched_lora.py), not PEFT's "
        "per-row hooks: the step stays compiled (a CUDA graph on a GPU) whatever the mix",
        "benchmarks/results/lora-batched-cpu.md",
        ("tiny", "125m"),
    ),
    "small_gemv": Rule(
        "cuda",
        "a compiled GPU step's one-row matmuls with at most 2048 outputs and inputs as inductor "
        "reductions (small_gemv.py)",
        "benchmarks/results/h200-20261126/README.md",
        ("1b",),
    ),
}


@dataclass(frozen=True)
class Policy:
    """Which rows of ``RULES`` an engine applies (a row of another device is always False; a
    row of device "any" applies on every device)."""

    cpu_attention_loops: bool = False
    eager_window: bool = False
    batched_lora: bool = False
    small_gemv: bool = False

    @classmethod
    def for_device(cls, device_type: str, off: Iterable[str] = ()) -> Policy:
        off = set(off)
        unknown = off - set(RULES)
        if unknown:
            from onegpu.errors import ConfigError

            raise ConfigError(
                f"engine policy_off: unknown rows {sorted(unknown)}.",
                hint=f"rows: {', '.join(RULES)}",
            )
        on = {n for n, r in RULES.items() if r.device in (device_type, "any") and n not in off}
        return cls(**{f.name: f.name in on for f in fields(cls)})


def describe() -> str:
    """The table as Markdown (docs and the results files quote it)."""
    lines = ["| row | device | what | results | shapes |", "|---|---|---|---|---|"]
    for name, r in RULES.items():
        lines.append(f"| {name} | {r.device} | {r.what} | {r.results} | {', '.join(r.shapes)} |")
    return "\n".join(lines)
