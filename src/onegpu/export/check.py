"""The check: the export, loaded in its own runtime, against onegpu's engine on the source model,
on the same prompts. Unquantized: greedy tokens equal for every prompt (the first divergence named,
a tie within numerical noise told apart). The report goes beside the export as export-check.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from onegpu.export.compare import GreedyResult, compare_greedy

REPORT = "export-check.json"
ExportGreedy = Callable[[list[int], int], tuple[list[int], np.ndarray]]


@dataclass
class Reference:
    """onegpu's engine on the source model: the prompts' ids and the greedy tokens it chose."""

    model: object
    tokenizer: object
    prompts: list[str]
    ids: list[list[int]]
    tokens: list[list[int]]
    description: str
    prompt_source: str = "built-in"  # prompts.CheckPrompts.source


@dataclass
class CheckReport:
    format: str
    runtime: str
    reference: str
    passed: bool
    summary: str
    results: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    prompts: str = "built-in"  # where the check's prompts came from

    def write(self, folder: Path) -> Path:
        path = folder / REPORT
        body = {
            "status": "passed" if self.passed else "failed: the export is unchecked",
            **self.__dict__,
        }
        path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        return path


def make_reference(
    model_dir: str,
    adapter: Optional[str],
    prompts: list[str],
    n: int,
    trust_remote_code=False,
    ids: Optional[list[list[int]]] = None,
    prompt_source: str = "built-in",
) -> Reference:
    """Load the source as `onegpu generate` does (float32, the adapter applied, not merged) and
    decode each prompt greedily on the engine. ``ids``: the prompts already rendered (the run's
    validation records); else ``prompts`` go in as `generate` feeds them."""
    from onegpu.export.runtimes import engine_greedy
    from onegpu.infer import InferConfig, load
    from onegpu.infer.generation import prompt_ids, use_chat

    loaded = load(
        InferConfig(
            model=model_dir, adapter=adapter, dtype="fp32", trust_remote_code=trust_remote_code
        )
    )
    if ids is None:
        chat = use_chat("auto", loaded.tokenizer, loaded.data_format)
        ids = prompt_ids(loaded.tokenizer, prompts, chat)
        how = "chat turns" if chat else "plain text"
    else:
        how = "rendered as training rendered them"
    tokens = engine_greedy(loaded.model, loaded.tokenizer, ids, n)
    what = f"onegpu engine, {model_dir}" + (f" + adapter {adapter}" if adapter else "")
    return Reference(
        loaded.model,
        loaded.tokenizer,
        prompts,
        ids,
        tokens,
        f"{what} (float32, greedy, {how})",
        prompt_source,
    )


def check_greedy(
    ref: Reference, export_greedy: ExportGreedy, dtype: str, fmt: str, runtime: str
) -> CheckReport:
    """Each prompt decoded by the export (``export_greedy(ids, n) -> tokens, logit rows``) and
    compared token by token with the engine's."""
    from onegpu.export.runtimes import forced_rows

    results: list[GreedyResult] = []
    for prompt, ids, want in zip(ref.prompts, ref.ids, ref.tokens, strict=True):
        got, rows = export_greedy(ids, len(want))
        src_rows = forced_rows(ref.model, ids, list(want))
        results.append(
            compare_greedy(
                prompt,
                want,
                got,
                lambda i, s=src_rows, r=rows: (s[i], r[i]),
                lambda t: ref.tokenizer.decode([t]),
                dtype,
            )
        )
    return CheckReport(
        fmt,
        runtime,
        ref.description,
        passed=all(r.status != "diverged" for r in results),
        summary=greedy_summary(results, fmt, runtime),
        results=[r.to_dict() for r in results],
        prompts=ref.prompt_source,
    )


def greedy_summary(results: list[GreedyResult], fmt: str, runtime: str) -> str:
    n = len(results)  # the prompts' source is added by export() once every verdict is in
    equal = sum(r.status == "equal" for r in results)
    ties = [r for r in results if r.status == "tie"]
    bad = [r for r in results if r.status == "diverged"]
    tokens = min((r.compared for r in results), default=0)
    head = f"check {fmt} in {runtime}: {equal}/{n} prompts' greedy tokens equal ({tokens} new each)"
    if ties:
        head += "; " + ", ".join(
            f"a tie at token {r.divergence.position} (gap {r.divergence.logit_gap:.2g})"
            for r in ties
        )
    if bad:
        d = bad[0].divergence
        where = (
            f"prompt {results.index(bad[0]) + 1} token {d.position}: engine {d.reference_token} "
            f"{d.reference_text!r}, export {d.export_token} {d.export_text!r}, logit gap "
            f"{d.logit_gap:.3g} (tie within {d.tie_tolerance:.2g})"
            if d
            else f"prompt {results.index(bad[0]) + 1}: lengths differ"
        )
        head += f"; FAILED, {len(bad)} diverged, first at {where}"
    return head
