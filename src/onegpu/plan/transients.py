"""Bytes that exist only at moments of a step (the loss's own peak, GRPO's sampling) and the dtypes
every part of the memory model counts in. Split from memory.py, which imports these."""

from __future__ import annotations

from onegpu.plan.arch import ModelShape
from onegpu.plan.candidate import Candidate


def param_bytes(precision: str) -> int:
    """Bytes per trainable weight: fp32 master weights under autocast, bf16 only for bf16-pure."""
    return 2 if precision == "bf16-pure" else 4


def act_bytes(c: Candidate) -> int:
    """Bytes per activation element: 16-bit compute keeps 16-bit activations."""
    return 2 if c.techniques.precision in ("fp16", "bf16", "bf16-pure") else 4


def loss_transient_bytes(shape: ModelShape, c: Candidate, tokens: int) -> float:
    """Bytes the loss holds above the kept activations at its own peak.

    Plain loss: at the start of backward, cross-entropy's two fp32 (tokens x vocab) gradients are
    alive together (nll_loss's, and log_softmax's computed from it); the cast back to the logits'
    dtype comes after the first is freed. Fused loss: the peak is inside its forward, which takes
    the head's gradient chunk by chunk (techniques/fused_loss.py): beside the kept activations it
    holds the fp32 sum of the head's gradient (counted as kept when the weights are fp32: the sum
    is the gradient), the previous chunk's gradient (still referenced while the next is computed)
    and, under autocast over fp32 weights, the weight's 16-bit copy. Its peak is either in a
    chunk's cross-entropy backward (three fp32 chunk x vocab tensors) or while the chunk's weight
    gradient is made (that gradient, and its 16-bit form under autocast).
    """
    t = c.techniques
    if c.training.objective == "reward":  # a score per row from the last hidden state, no vocab
        return 0.0
    if not t.loss_chunk_size:
        return 8.0 * tokens * shape.vocab
    chunk = min(t.loss_chunk_size, tokens) * shape.vocab
    cast = 2 if t.precision in ("fp16", "bf16") else 0  # autocast's 16-bit copy of fp32 weights
    head = shape.vocab * shape.hidden
    if c.lora_rank:  # a frozen head: no gradient sums, only the weight's copy the matmul saves
        return cast * head + 12.0 * chunk
    pb = param_bytes(t.precision)
    held = (4 - pb) + pb + cast  # fp32 sums beyond the kept gradient, previous chunk's, weight copy
    return max(held * head + 12.0 * chunk, (held + pb + cast) * head + 2.0 * chunk)


def rollout_bytes(shape: ModelShape, c: Candidate, seq_len: int) -> float:
    """GRPO's sampling (objectives/rollout.py), between steps, when no gradient or activation
    exists: the KV cache of the step's completions, all sampled in one ``generate`` call, at full
    length (prompts left-padded to seq_len, plus the completion), in the compute dtype; and the
    last position's logits, which generate makes fp32, with the sampler's softmax and its
    filtered copy beside them."""
    cfg = shape.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or shape.heads
    head_dim = getattr(cfg, "head_dim", None) or shape.hidden // max(shape.heads, 1)
    rows = c.effective_batch
    # with tools, each row's conversation: max_turns turns and the tool results between them
    cache = rows * (seq_len + c.grpo.completion_tokens()) * shape.layers * 2 * kv_heads
    return cache * head_dim * act_bytes(c) + 3 * rows * shape.vocab * 4
