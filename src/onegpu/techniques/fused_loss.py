"""Fused output head + cross-entropy ("fused linear cross-entropy", as in Liger-Kernel and Unsloth),
and the per-token log-probs preference losses need, computed the same chunked way.

The plain loss writes (tokens x vocab) fp32 logits, log-softmax writes a second tensor of that size,
and backward two more: gigabytes at a 128k vocabulary, and most of a small model's memory traffic.
Here the head runs over ``chunk`` tokens at a time and each chunk's gradients (for the hidden
states and the head's trainable parameters) are taken at once, in the forward, while that chunk's
logits are still in cache. Backward only scales the stored gradients by the incoming one. Nothing
is recomputed (unlike a checkpointed chunked loss), and one chunk's logits are the most that ever
exist. Measured on the `tiny` preset on a CPU: head + loss ~1.6x faster, whole step ~1.2x.

A method applied to the model's head, like checkpointing to its blocks: it reaches the final hidden
states (a forward hook on the decoder, ``run_keeping_hidden``), rebuilds the head with its logit
scaling (``Head``) and checks once that it reproduces the model's own logits. The objectives use it
through objectives/tokens.TokenLoss, which also falls back to the plain loss where it cannot serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onegpu.errors import UnavailableError

# Logits per chunk. A CPU wants a chunk that stays in its last-level cache (8 MB of fp32 at this
# size: 256 tokens at a 8k vocabulary measured fastest); a GPU wants matmuls large enough to fill
# it.
CPU_CHUNK_ELEMENTS = 2**21
GPU_CHUNK_ELEMENTS = 2**25


def auto_chunk(vocab: int, on_gpu: bool) -> int:
    """Tokens per chunk for this vocabulary: a power of two near the target logits per chunk."""
    target = GPU_CHUNK_ELEMENTS if on_gpu else CPU_CHUNK_ELEMENTS
    lo, hi = (128, 8192) if on_gpu else (32, 4096)
    tokens = max(lo, min(hi, target // max(vocab, 1)))
    return 1 << (tokens.bit_length() - 1)


def fused_head_loss(head, h: torch.Tensor, y: torch.Tensor, chunk: int, amp) -> torch.Tensor:
    """Summed cross-entropy of ``head.logits(h)`` against ``y`` (rows of h: tokens that have a
    target), computed ``chunk`` tokens at a time. ``head.parameters()`` are the tensors the logits
    depend on; those that require grad get their gradient here."""
    params = [p for p in head.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (h.requires_grad or params):
        with torch.no_grad():  # evaluation: the loss alone, still one chunk of logits at a time
            return sum(
                (
                    _chunk_loss(head, h[s : s + chunk], y[s : s + chunk], amp)
                    for s in range(0, y.numel(), chunk)
                ),
                h.new_zeros((), dtype=torch.float32),
            )
    return _FusedHeadLoss.apply(head, chunk, amp, h, y, *params)


def _chunk_loss(head, h: torch.Tensor, y: torch.Tensor, amp) -> torch.Tensor:
    device_type, enabled, dtype = amp
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        z = head.logits(h)
    return F.cross_entropy(z.float(), y, reduction="sum")


class _FusedHeadLoss(torch.autograd.Function):
    """``params`` are the head's trainable tensors (fused_head_loss passes only those)."""

    @staticmethod
    def forward(ctx, head, chunk: int, amp, h, y, *params):
        want_h = ctx.needs_input_grad[3]
        grad_h = torch.empty_like(h) if want_h else None
        # Sums over chunks in fp32 whatever the parameters' dtype (bf16 sums would lose precision).
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.enable_grad():
            for start in range(0, y.numel(), chunk):
                sl = slice(start, start + chunk)
                hc = h[sl].detach().requires_grad_(want_h)
                loss = _chunk_loss(head, hc, y[sl], amp)
                grads = torch.autograd.grad(loss, ([hc] if want_h else []) + list(params))
                if want_h:
                    grad_h[sl] = grads[0]
                for acc, g in zip(sums, grads[int(want_h) :], strict=True):
                    acc.add_(g)
                total += loss.detach()
        ctx.grad_h = grad_h
        # no copy when already fp32
        ctx.grad_params = [s.to(p.dtype) for s, p in zip(sums, params, strict=True)]
        return total

    @staticmethod
    def backward(ctx, grad_out):
        # The stored gradients are used once: scale them in place rather than allocate copies.
        grads = [
            g.mul_(grad_out.to(g.dtype)) if g is not None else None
            for g in (ctx.grad_h, *ctx.grad_params)
        ]
        ctx.grad_h = ctx.grad_params = None
        return (None, None, None, grads[0], None, *grads[1:])


# ------------------------------------------------------------------------------ per-token log-probs
def fused_token_logps(
    head, h: torch.Tensor, y: torch.Tensor, chunk: int, amp, temperature: float = 1.0
) -> torch.Tensor:
    """log p(y_i | h_i) for every row, fp32, ``chunk`` rows of logits at a time (the logits divided
    by ``temperature`` first, as a sampler at that temperature drew y).

    Preference losses need these per token (summed per sequence, then passed through a non-linear
    loss), so the incoming gradient is a vector known only after the whole batch's forward: unlike
    the cross-entropy above, the gradients cannot be taken in the forward. Backward therefore runs
    the head again, chunk by chunk (one chunk of logits alive at a time, as in the forward): one
    extra head matmul buys never holding the (tokens x vocab) logits.
    """
    return fused_policy_logps(head, h, y, chunk, amp, temperature, entropy=False)[0]


def fused_policy_logps(
    head, h, y, chunk: int, amp, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs as ``fused_token_logps``, the entropy of each row's distribution or None): the
    entropy comes from the same chunk of logits, without a gradient (a statistic for the log)."""
    params = [p for p in head.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (h.requires_grad or params):
        with torch.no_grad():
            return _all_chunks(head, h, y, chunk, amp, temperature, entropy)
    return _FusedTokenLogps.apply(head, chunk, amp, temperature, entropy, h, y, *params)


def _chunk_logps(
    head, h: torch.Tensor, y: torch.Tensor, amp, temperature: float = 1.0, entropy: bool = False
):
    device_type, enabled, dtype = amp
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        z = head.logits(h)
    z = z.float() if temperature == 1.0 else z.float() / temperature
    logps = -F.cross_entropy(z, y, reduction="none")
    if not entropy:
        return logps, None
    with torch.no_grad():
        logp = F.log_softmax(z.detach(), dim=-1)
        return logps, -(logp.exp() * logp).sum(-1)


def _all_chunks(head, h, y, chunk, amp, temperature: float = 1.0, entropy: bool = False):
    if y.numel() == 0:
        empty = h.new_zeros((0,), dtype=torch.float32)
        return empty, (empty.clone() if entropy else None)
    parts = [
        _chunk_logps(head, h[s : s + chunk], y[s : s + chunk], amp, temperature, entropy)
        for s in range(0, y.numel(), chunk)
    ]
    ent = torch.cat([e for _, e in parts]) if entropy else None
    return torch.cat([lp for lp, _ in parts]), ent


class _FusedTokenLogps(torch.autograd.Function):
    H = 5  # position of h among forward's inputs

    @staticmethod
    def forward(ctx, head, chunk: int, amp, temperature, entropy, h, y, *params):
        with torch.no_grad():
            out, ent = _all_chunks(head, h, y, chunk, amp, temperature, entropy)
        ctx.head, ctx.chunk, ctx.amp, ctx.temperature = head, chunk, amp, temperature
        ctx.save_for_backward(h, y, *params)
        if ent is None:
            return out, None
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy=None):
        h, y, *params = ctx.saved_tensors
        want_h = ctx.needs_input_grad[_FusedTokenLogps.H]
        grad_h = torch.zeros_like(h) if want_h else None
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        with torch.enable_grad():
            for start in range(0, y.numel(), ctx.chunk):
                sl = slice(start, start + ctx.chunk)
                hc = h[sl].detach().requires_grad_(want_h)
                logps, _ = _chunk_logps(ctx.head, hc, y[sl], ctx.amp, ctx.temperature)
                grads = torch.autograd.grad(
                    logps,
                    ([hc] if want_h else []) + list(params),
                    grad_outputs=grad_out[sl],
                    allow_unused=True,
                )
                if want_h:
                    grad_h[sl] = grads[0]
                for acc, g in zip(sums, grads[int(want_h) :], strict=True):
                    if g is not None:
                        acc.add_(g)
        ctx.head = None
        return (
            None,
            None,
            None,
            None,
            None,
            grad_h,
            None,
            *[s.to(p.dtype) for s, p in zip(sums, params, strict=True)],
        )


def fused_chunk(tcfg, vocab: int, on_gpu: bool, sharded: bool) -> int:
    """Tokens per chunk of the fused loss as techniques.loss / loss_chunk_size resolve on this
    device; 0 = the plain loss (asked for, or the head's weights are sharded)."""
    if tcfg.loss == "plain" or sharded:
        return 0
    return tcfg.loss_chunk_size or auto_chunk(vocab, on_gpu)


# ----------------------------------------------------------------------- the head, reached
def run_keeping_hidden(model, inputs: dict):
    """Run the model with only the last position's logits; return (output, final hidden states,
    the autocast state the forward ran under)."""
    captured = _capture_slot(model)
    try:
        try:
            out = model(**inputs, logits_to_keep=1)
        except TypeError as exc:  # custom model code without the argument
            if "logits_to_keep" not in str(exc):
                raise
            raise UnavailableError(
                f"techniques.loss=fused: {type(model).__name__} cannot skip computing "
                "its full logits (no logits_to_keep argument).",
                hint="set techniques.loss=plain for this model",
            ) from None
        if "hidden" not in captured:
            raise UnavailableError(
                f"techniques.loss=fused: cannot reach the final hidden states of "
                f"{type(model).__name__}.",
                hint="set techniques.loss=plain for this model",
            )
        return out, captured["hidden"], captured["amp"]
    finally:
        captured.clear()  # do not keep the last batch's activations alive between steps


def _capture_slot(model) -> dict:
    """A dict the decoder fills with its output on every forward.

    The hook is registered once and left in place: a hook added per call would change the module's
    hooks each step and make a compiled model recompile every time.
    """
    decoder = _unwrap(model).get_decoder()
    slot = getattr(decoder, "_onegpu_hidden", None)
    if slot is not None:
        return slot
    slot = {}

    def grab(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        dev = hidden.device.type
        slot["hidden"] = hidden
        slot["amp"] = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))

    decoder.register_forward_hook(grab)
    decoder._onegpu_hidden = slot
    return slot


def _unwrap(model):
    """The model inside a DistributedDataParallel wrapper (which has no get_decoder). Not
    accelerate's extract_model_from_parallel: it imports DeepSpeed, seconds on every run."""
    return (
        getattr(model, "module", model)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel)
        else model
    )


class Head:
    """The model's output head, with the logit scaling / soft-capping its config declares."""

    def __init__(self, model):
        self.model = model = _unwrap(model)
        self.linear = model.get_output_embeddings()
        cfg = model.config
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.scale = getattr(cfg, "logit_scale", None)  # Cohere: logits * scale
        self.divide = getattr(cfg, "logits_scaling", None)  # Granite: logits / scaling

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = self.linear(h)
        if self.scale is not None:
            z = z * self.scale
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def parameters(self):
        """What the logits depend on besides the hidden states (the head's weight, adapters)."""
        return self.linear.parameters()

    @torch.no_grad()
    def verify(self, h_last: torch.Tensor, model_logits: torch.Tensor, amp) -> None:
        """Once per model: our head must reproduce the model's own last-position logits, or the
        model post-processes logits in a way we do not know, and chunking would change the loss."""
        if getattr(self.model, "_onegpu_head_verified", False):
            return
        device_type, enabled, dtype = amp
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            ours = self.logits(h_last).float()
        theirs = model_logits[:, -1:].float()
        tol = 1e-4 if h_last.dtype == torch.float32 and not enabled else 2e-2
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=tol, atol=tol * 10):
            raise UnavailableError(
                f"techniques.loss=fused: {type(self.model).__name__} transforms its "
                "logits in a way the fused loss cannot reproduce.",
                hint="set techniques.loss=plain for this model",
            )
        self.model._onegpu_head_verified = True
