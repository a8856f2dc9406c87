"""The engine's per-device choices, in one table: what each does, its setting, the results file
that justifies it and the model shapes it was measured on. Every row can be switched off
(``EngineConfig.policy_off``: the names of the rows to leave out), and a row whose gain does not
hold on a second shape is not in the table.

The engine reads it through a ``Policy``; ``onegpu doctor`` and serve's start-up line print
``summary``. ``--policy_off ROW[,ROW]`` (``parse_off``) reaches it from ``onegpu generate``,
``onegpu serve``, ``onegpu bench infer`` and GRPO's sampler (``grpo.policy_off``).

The CPU rows were measured on the ``tiny`` and ``125m`` presets
(``benchmarks/results/engine-policy-cpu.md``, by ``policy_ab.py`` at cceb151); the CUDA rows on
the ``1b`` preset on an H200, and are to be measured on an 8B shape on the next card
(``scripts/gpu_check.sh policy``). Three CPU rows timed on ``tiny`` alone before went when the
``125m`` shape did not gain from them (the same file): inductor's realize threshold for the
query, the frozen step (weights folded in, C++ GEMM templates, a C++ wrapper: 8% slower at
``125m``) and skipping a warm bucket's guards. ``cpu_head_reduction`` (the output head's
one-row product as inductor's reduction) was timed on and off by the same script
(engine-head-reduction-cpu.md) and in the engine's decode A/B (engine-decode-speed-cpu.md).
A row of device "any" applies on every device:
``batched_lora`` (a compiled step with adapters at all, a CUDA graph on a GPU) was measured on
the CPU shapes (``benchmarks/lora_batched.py``) and is to be timed on the next card.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Optional

from onegpu.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    device: str
    what: str
    results: str
    shapes: tuple[str, ...]
    why: str = ""  # what the results file measured, in a line (doctor and serve print it)


# The token budget of a CPU step (the cpu_token_budget row): engine-budget-cpu.md and
# engine-budget-125m-cpu.md time 64-1024 on the tiny and 125m shapes
CPU_TOKEN_BUDGET = 256


RULES: dict[str, Rule] = {
    "cpu_attention_loops": Rule(
        "cpu",
        "a compiled decode step attends in inductor's loops over the blocks where they lie "
        "(cpu_attention.py), not SDPA's kernel over a gathered copy (at every row count: from 2 "
        "rows over the slot cache's views, from 1 over the paged pool)",
        "benchmarks/results/engine-policy-cpu.md",
        ("tiny", "125m"),
        "a compiled CPU step faster on both shapes than SDPA's kernel",
    ),
    "cpu_head_reduction": Rule(
        "cpu",
        "a compiled one-row decode step multiplies by the output head (8,192 outputs or more) as "
        "inductor's C++ reduction over the head's rows (small_gemv.head), not MKL's matmul",
        "benchmarks/results/engine-head-reduction-cpu.md",
        ("tiny", "125m"),
        "the one-row step faster on both shapes than with MKL's product",
    ),
    "eager_window": Rule(
        "cpu",
        "an eager decode run reads a copy of its rows' blocks, gathered at its first step and "
        "kept up to date by each (paged_cache.Window), not a gather at every step",
        "benchmarks/results/engine-policy-cpu.md",
        ("tiny", "125m"),
        "an eager CPU step faster on both shapes than a gather at every step",
    ),
    "batched_lora": Rule(
        "any",
        "a decode run whose rows name LoRA adapters adds each row's adapter as batched matmuls "
        "over the adapters' stacked weights, indexed by row (batched_lora.py), not PEFT's "
        "per-row hooks: the step stays compiled (a CUDA graph on a GPU) whatever the mix",
        "benchmarks/results/lora-batched-cpu.md",
        ("tiny", "125m"),
        "a mixed batch of adapters decodes compiled, not eagerly through PEFT's hooks",
    ),
    "small_gemv": Rule(
        "cuda",
        "a compiled GPU step's one-row matmuls with at most 2048 outputs and inputs as inductor "
        "reductions (small_gemv.py)",
        "benchmarks/results/h200-20261126/README.md",
        ("1b",),
        "the 1b step at batch 1 1.40 against 1.59 ms (an 8B shape is still to be timed)",
    ),
    "gqa_decode": Rule(
        "cuda",
        "a GQA model's decode steps pack each key head's query heads as query tokens of one SDPA "
        "call over the cache as it is (gqa_attention.py), not repeat_kv's copy per query head",
        "benchmarks/results/h200-20261126/README.md",
        ("1b",),
        "the 1b step at batch 8 1.709 against 1.972 ms (batch 1 1.589 against 1.553; a second "
        "GQA shape is still to be timed; on a CPU not timed: none of the CPU presets is GQA)",
    ),
    "moe_batched_mm": Rule(
        "any",
        "a compiled decode step runs MoE experts as batched_mm (no host read of the routing, "
        "fixed shapes) in the engine's copy of the model; the prefill keeps the model's kernel",
        "benchmarks/results/h200-20261125/README.md",
        ("mixtral", "qwen3_moe"),
        "a CUDA graph capture refused transformers' grouped_mm fallback (its tolist())",
    ),
    "cpu_token_budget": Rule(
        "cpu",
        f"a CPU step computes at most {CPU_TOKEN_BUDGET} tokens (decode rows and prompt pieces) "
        "when EngineConfig.token_budget is not given; off (and on a GPU, unmeasured) a step may "
        "compute a whole max_len prompt",
        "benchmarks/results/engine-budget-cpu.md",
        ("tiny", "125m"),
        "a long prompt's first token 2.4x (tiny) and 1.7x (125m) sooner than at 64 tokens, the "
        "streams' p50 gap within 8% (engine-budget-125m-cpu.md for the 125m)",
    ),
}


@dataclass(frozen=True)
class Policy:
    """Which rows of ``RULES`` an engine applies (a row of another device is always False; a
    row of device "any" applies on every device)."""

    cpu_attention_loops: bool = False
    cpu_head_reduction: bool = False
    eager_window: bool = False
    batched_lora: bool = False
    small_gemv: bool = False
    gqa_decode: bool = False
    moe_batched_mm: bool = False
    cpu_token_budget: bool = False

    @classmethod
    def for_device(
        cls, device_type: str, off: Iterable[str] = (), on: Iterable[str] = ()
    ) -> Policy:
        """The rows of ``device_type`` but those ``off``, and those ``on`` whatever their device
        (another device's row run here: to test or time its path)."""
        off, forced = set(off), set(on)
        for name, rows in (("policy_off", off), ("policy_on", forced)):
            unknown = rows - set(RULES)
            if unknown:
                raise ConfigError(
                    f"engine {name}: unknown rows {sorted(unknown)}.",
                    hint=f"rows: {', '.join(RULES)}",
                )
        mine = {n for n, r in RULES.items() if r.device in (device_type, "any")}
        chosen = (mine - off) | forced
        return cls(**{f.name: f.name in chosen for f in fields(cls)})

    def on(self) -> tuple[str, ...]:
        """The names of the rows applied, in the table's order (EngineStats.policy_rows)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


def parse_off(text: Optional[str], flag: str = "--policy_off") -> list[str]:
    """``--policy_off ROW[,ROW]``: the rows' names; a name not in the table is a ConfigError
    naming ``flag`` (the option as its command spells it: ``--grpo.policy_off`` for GRPO's) and
    the rows there are."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise ConfigError(
            f"{flag}: unknown policy rows {unknown}.",
            hint=f"name rows of: {', '.join(RULES)} (`onegpu doctor` says which are on, and why)",
        )
    return names


def summary(
    device_type: str, off: Iterable[str] = (), on: Optional[Iterable[str]] = None
) -> list[str]:
    """One line a row of ``device_type`` (and a row of another device that is on): on or off,
    what it measured and where. ``on``: the rows an engine applies (its
    ``stats().policy_rows``); default the device's rows but those ``off``."""
    applied = set(Policy.for_device(device_type, off).on() if on is None else on)
    lines = []
    for name, r in RULES.items():
        if r.device not in (device_type, "any") and name not in applied:
            continue
        state = "on " if name in applied else "off"
        lines.append(f"{state} {name}: {r.why} ({r.results}; shapes {', '.join(r.shapes)})")
    return lines


def describe() -> str:
    """The table as Markdown (docs and the results files quote it)."""
    lines = ["| row | device | what | results | shapes |", "|---|---|---|---|---|"]
    for name, r in RULES.items():
        lines.append(f"| {name} | {r.device} | {r.what} | {r.results} | {', '.join(r.shapes)} |")
    return "\n".join(lines)
