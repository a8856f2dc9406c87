"""The check's verdicts from token ids and logit rows alone (no runtime here): greedy tokens
equal, the first divergence with both tokens and the logit gap there, a tie within the export's
numerical precision, and for a quantized export the teacher-forced top-1 agreement and the
perplexity ratio."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

# One rounding step of each dtype relative to a value (2^-mantissa bits). Two tokens whose logits
# differ by less than TIE_STEPS such steps of the largest logit at that position can swap places
# from rounding alone (the weights and every layer's sums are rounded): a tie, not a failure.
UNIT_STEP = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
TIE_STEPS = 8


@dataclass
class Divergence:
    position: int  # index among the new tokens
    reference_token: int
    export_token: int
    reference_text: str
    export_text: str
    logit_gap: float  # the source's logit of its token minus its logit of the export's token
    export_gap: float  # the export's logit of its token minus its logit of the source's token
    tie_tolerance: float
    tie: bool


@dataclass
class GreedyResult:
    prompt: str
    compared: int  # new tokens compared
    equal: int  # leading new tokens that are the same
    status: str  # "equal", "tie" (diverged within numerical noise) or "diverged"
    divergence: Optional[Divergence] = None

    def to_dict(self) -> dict:
        return asdict(self)


def tie_tolerance(row: Sequence[float], dtype: str) -> float:
    return (
        TIE_STEPS
        * UNIT_STEP.get(dtype, UNIT_STEP["bfloat16"])
        * max(1.0, float(np.abs(np.asarray(row, np.float64)).max()))
    )


def compare_greedy(
    prompt: str,
    reference: Sequence[int],
    exported: Sequence[int],
    rows_at: Callable[[int], tuple[Sequence[float], Sequence[float]]],
    decode: Callable[[int], str],
    dtype: str,
) -> GreedyResult:
    """``rows_at(i)``: (source's, export's) logits for new token ``i``, both given the same ids
    before it; called only at a divergence."""
    n = min(len(reference), len(exported))
    at = next((i for i in range(n) if reference[i] != exported[i]), None)
    if at is None:
        status = "equal" if len(reference) == len(exported) else "diverged"
        return GreedyResult(prompt, n, n, status)
    src, exp = rows_at(at)
    r, e = int(reference[at]), int(exported[at])
    gap = float(src[r] - src[e])
    tol = tie_tolerance(src, dtype)
    div = Divergence(
        at, r, e, decode(r), decode(e), gap, float(exp[e] - exp[r]), tol, abs(gap) <= tol
    )
    return GreedyResult(prompt, n, at, "tie" if div.tie else "diverged", div)


def top1_agreement(src_rows, exp_rows) -> float:
    """Share of positions whose most likely token is the same (rows: [positions, vocab])."""
    src, exp = np.asarray(src_rows, np.float64), np.asarray(exp_rows, np.float64)
    if src.shape != exp.shape or not len(src):
        raise ValueError(f"logit rows differ in shape: {src.shape} vs {exp.shape}")
    return float((src.argmax(-1) == exp.argmax(-1)).mean())


def perplexity(rows, targets: Sequence[int]) -> float:
    """exp(mean negative log-likelihood of ``targets[i]`` under ``rows[i]``)."""
    x = np.asarray(rows, np.float64)
    top = x.max(-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(x - top).sum(-1))
    nll = lse - x[np.arange(len(x)), np.asarray(targets)]
    return float(math.exp(nll.mean()))
