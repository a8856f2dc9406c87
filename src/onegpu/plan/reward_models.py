"""The memory of GRPO's trained reward models (grpo.rewards entries that are a model's folder,
objectives/reward_model.py): their weights, resident from the first scoring to the end of the run,
and the scoring forward's peak, a moment of its own between sampling and the training forward.

The weights are counted in the dtype the reward model loads in: bf16 on a GPU (reward_model._load
asks for it where the card has it), else the dtype it was saved in (from_pretrained's "auto").
The scoring forward runs under inference_mode over reward_model.BATCH texts at a time, each as
long as the policy's rows (prompt + completion), so at most one block's tensors exist: its input
and normalised input, q / k / v with their rotated copies and the attention output (about seven
tokens x hidden), then the MLP's gate-activation, up projection and their product (three tokens x
intermediate). SDPA's fused kernels (a GPU's, and the CPU's flash kernel) never hold the
length x length scores.
"""

from __future__ import annotations

from dataclasses import dataclass

from onegpu.plan.candidate import Candidate

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RewardModelBytes:
    weights: float  # every reward model's weights, resident
    scoring: float  # the largest one's scoring forward, above the weights


def folders(c: Candidate) -> list[str]:
    """The entries of grpo.rewards that are a reward model's folder."""
    from onegpu.objectives.reward_model import is_reward_model

    if c.training.objective != "grpo":
        return []
    return [name for name in c.grpo.rewards if is_reward_model(name)]


def load_bytes(config, on_gpu: bool) -> int:
    """Bytes per weight as reward_model._load loads it."""
    if on_gpu:
        return 2
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4)


def scoring_bytes(shape, rows: int, length: int, b: int) -> float:
    """One scoring forward's peak above the weights (the module's docstring)."""
    from onegpu.objectives.reward_model import BATCH

    rows = min(rows, BATCH)
    tokens = rows * length
    return float(tokens * (7 * shape.hidden + 3 * shape.intermediate) * b)


def reward_model_bytes(c: Candidate, seq_len: int, on_gpu: bool) -> RewardModelBytes | None:
    """The reward models' weights and scoring peak for this GRPO setup (None: it has none).
    ``seq_len``: the prompt's length; each scored text adds the completion's."""
    from onegpu.plan.arch import cached_shape

    paths = folders(c)
    if not paths:
        return None
    weights, scoring = 0.0, 0.0
    length = seq_len + c.grpo.max_completion_length
    for path in paths:
        shape = cached_shape(path, score_head=True)
        b = load_bytes(shape.config, on_gpu)
        weights += shape.params * b
        scoring = max(scoring, scoring_bytes(shape, c.effective_batch, length, b))
    return RewardModelBytes(weights, scoring)
