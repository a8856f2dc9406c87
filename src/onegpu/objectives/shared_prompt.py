"""techniques.shared_prompt: a reward model scores a pair's chosen and rejected responses in one
row, after one copy of the prompt they share, instead of two rows that each repeat it.

Row of a pair:  prompt | chosen | rejected, with position ids 0..P-1 | P..P+C-1 | P..P+R-1 and a
mask in which the prompt is causal, each response sees the prompt and its own earlier tokens, and
never the other response. Every token then sees exactly what it sees in its own padded row (the
same positions, the same keys), so the head's two scores, read at the two responses' last
tokens, and the gradients are those of the two-row batch (up to float summation order); the
prompt is computed once. Reward data's prompts are often longer than their responses (the
default pairs: six lines of prompt, four of response), so this is most of a step's tokens.

The collator (data/pairs.PairCollator) adds the row's layout to the usual two-row batch as index
tensors, so the choice can wait for the model: ``applies`` says whether this model can take it.
"""

from __future__ import annotations

import torch

INDEX, POSITIONS, SEGMENTS, ENDS = (
    "shared_index",
    "shared_positions",
    "shared_segments",
    "shared_ends",
)
KEYS = (INDEX, POSITIONS, SEGMENTS, ENDS)
PROMPT, CHOSEN, REJECTED, PAD = 0, 1, 2, -1
ATTENTION = ("sdpa", "eager")  # the kernels that take a 4D mask as given


def layout(
    prompt_lens: list[int],
    chosen_lens: list[int],
    rejected_lens: list[int],
    width: int,
    multiple: int = 1,
):
    """The shared rows of n pairs whose two-row batch is (2n, ``width``), chosen rows first:
    gather indices into its flattened input_ids, position ids, segments (PAD past a row's end)
    and each row's two end positions (chosen, rejected). The rows' width is rounded up to
    ``multiple``, as the collator rounds the two-row batch's (one compiled shape per bucket)."""
    n = len(prompt_lens)
    rows = [p + c + r for p, c, r in zip(prompt_lens, chosen_lens, rejected_lens, strict=True)]
    w = -(-max(rows) // multiple) * multiple
    index = torch.zeros(n, w, dtype=torch.long)
    pos = torch.zeros(n, w, dtype=torch.long)
    seg = torch.full((n, w), PAD, dtype=torch.long)
    ends = torch.zeros(n, 2, dtype=torch.long)
    for i, (p, c, r) in enumerate(zip(prompt_lens, chosen_lens, rejected_lens, strict=True)):
        chosen_row, rejected_row = i * width, (n + i) * width
        index[i, : p + c] = torch.arange(chosen_row, chosen_row + p + c)
        index[i, p + c : p + c + r] = torch.arange(rejected_row + p, rejected_row + p + r)
        index[i, p + c + r :] = chosen_row  # padding: any token; the mask hides it
        pos[i, : p + c] = torch.arange(p + c)
        pos[i, p + c : p + c + r] = torch.arange(p, p + r)
        seg[i, :p], seg[i, p : p + c], seg[i, p + c : p + c + r] = PROMPT, CHOSEN, REJECTED
        ends[i] = torch.tensor([p + c - 1, p + c + r - 1])
    return {INDEX: index, POSITIONS: pos, SEGMENTS: seg, ENDS: ends}


def mask(segments: torch.Tensor, dtype: torch.dtype, additive: bool) -> torch.Tensor:
    """(n, 1, w, w) attention mask of the shared rows: causal, the prompt seen by all, a response
    by itself only, padding by none (a padding query sees itself, so no row of the softmax is
    empty). ``additive``: 0 / the dtype's minimum, as eager attention adds it; else True = attend,
    as SDPA takes it."""
    w = segments.size(1)
    idx = torch.arange(w, device=segments.device)
    causal = idx[:, None] >= idx[None, :]
    q, k = segments[:, :, None], segments[:, None, :]
    allowed = causal & (k != PAD) & ((k == q) | (k == PROMPT))
    allowed = allowed | torch.eye(w, dtype=torch.bool, device=segments.device)
    allowed = allowed[:, None]
    if not additive:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=segments.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def parts(model):
    """(the backbone, the score head) of a sequence-classification model, through PEFT's wrapper
    if there is one; None where the model has no such pair."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = getattr(base, "score", None)
    if not isinstance(backbone, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return None
    return backbone, head


def applies(model) -> str | None:
    """None where ``model`` can run the shared rows, else why not (a sentence)."""
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(
        model, "_orig_mod"
    )
    if wrapped or getattr(model, "_compiled_call_impl", None) is not None:
        # (regional compile compiles the decoder blocks in place: those the shared rows run too)
        return "the model is wrapped or compiled whole (DDP, torch.compile), so it must run whole"
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION:
        return f"attention {impl} takes no custom mask (sdpa and eager do)"
    if any(
        getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        return "an MoE model's router loss comes from the whole model's forward"
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or any("sliding" in str(t) for t in types):
        return "sliding-window attention would need the window in the mask"
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model's images enter through its whole forward"
    if parts(model) is None:
        return "the model has no backbone and score head to call apart"
    return None


def scores(model, batch: dict, trim: bool = False) -> torch.Tensor:
    """(n, 2) fp32 scores (chosen, rejected) of the batch's pairs from their shared rows.
    ``trim``: leave out the columns that are padding in every row first, as reward.trimmed does
    for the two-row batch (an eager CPU step; reading the width waits for the device)."""
    backbone, head = parts(model)
    index, seg, pos = batch[INDEX], batch[SEGMENTS], batch[POSITIONS]
    if trim:
        width = int(batch[ENDS].max()) + 1
        index, seg, pos = index[:, :width], seg[:, :width], pos[:, :width]
    ids = batch["input_ids"].reshape(-1)[index]
    param = next(head.parameters())
    additive = model.config._attn_implementation == "eager"
    m = mask(seg, param.dtype, additive)
    hidden = backbone(input_ids=ids, attention_mask=m, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state
    rows = torch.arange(ids.size(0), device=ids.device)[:, None]
    return head(hidden[rows, batch[ENDS]]).squeeze(-1).float()
