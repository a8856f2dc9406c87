"""Causal-LM loss as a *sum* over target tokens, so the loop can normalise by the real token count
of the whole accumulated batch (transformers#34191: per-micro-batch means weight tokens unevenly).

With ``chunk_size > 0`` the full-vocabulary logits are never materialised (transformers#30860):
the model runs with ``logits_to_keep=1``, the final hidden states are taken from its decoder, and
the output head + cross-entropy run fused, ``chunk_size`` tokens at a time (see fused_loss.py).

Mixture-of-Experts models add their router load-balancing loss (see ``moe_aux_term``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from onegpu.errors import UnavailableError
from onegpu.techniques.moe import moe_aux_term

log = logging.getLogger(__name__)

IGNORE = -100
TARGETS = "target_positions"  # batch key: see with_target_positions


def model_inputs(batch: dict) -> dict:
    """Forward arguments for a loss computation. No KV cache: it is never read here, and its
    presence stops transformers from detecting packed documents."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    if "position_ids" in inputs:
        # Packed rows (padding-free): transformers separates the documents from the restarting
        # position_ids, but only when no 2-D attention mask is given.
        inputs.pop("attention_mask", None)
    inputs["use_cache"] = False
    return inputs


def normaliser(loss_fn):
    """What a loss function's summed loss is divided by, per micro-batch: its own ``count`` (pairs, for
    the preference losses), else the target tokens (``with_target_positions`` has been applied)."""
    return getattr(loss_fn, "count", None) or (lambda batch: batch[TARGETS].numel())


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that count in the loss: labels shifted by one, -100 excluded."""
    return int((labels[:, 1:] != IGNORE).sum())


def loss_sum(model, batch: dict, chunk_size: int = 0) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch (fp32 accumulation), plus the MoE router
    loss where the model has one."""
    labels = batch["labels"][:, 1:]
    if chunk_size > 0:
        out, loss = _chunked_forward(model, batch, chunk_size)
    else:
        out = model(**model_inputs(batch))
        # Shift the labels, not the logits: slicing logits[:, :-1] would copy (tokens x vocab).
        targets = F.pad(labels, (0, 1), value=IGNORE)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
    return loss + moe_aux_term(model, out, labels)


def fused_chunk(tcfg, vocab: int, on_gpu: bool, sharded: bool) -> int:
    """Tokens per chunk of the fused loss as techniques.loss / loss_chunk_size resolve on this
    device; 0 = the plain loss (asked for, or the head's weights are sharded)."""
    from onegpu.techniques.fused_loss import auto_chunk

    if tcfg.loss == "plain" or sharded:
        return 0
    return tcfg.loss_chunk_size or auto_chunk(vocab, on_gpu)


class LossFn:
    """The run's ``(model, batch) -> summed loss``, from techniques.loss / loss_chunk_size.

    With loss=auto a model the fused loss cannot serve (no logits_to_keep, logits it cannot
    reproduce) falls back to the plain loss on the first batch, once, with a log line; with
    loss=fused the same is an error.
    """

    def __init__(self, chunk_size: int, fallback: bool = False):
        self.chunk_size, self.fallback = chunk_size, fallback

    @classmethod
    def for_run(cls, tcfg, vocab: int, on_gpu: bool, sharded: bool) -> "LossFn":
        from onegpu.errors import ConfigError

        if tcfg.loss == "fused" and sharded:
            raise ConfigError("techniques.loss=fused needs the output head's weights whole in every process, "
                              "but FSDP2 / DeepSpeed ZeRO-3 shards them.", hint="set techniques.loss=auto (or plain)")
        return cls(fused_chunk(tcfg, vocab, on_gpu, sharded), fallback=tcfg.loss == "auto")

    @property
    def fused(self) -> bool:
        return self.chunk_size > 0

    def __call__(self, model, batch: dict) -> torch.Tensor:
        if self.chunk_size:
            try:
                return loss_sum(model, batch, self.chunk_size)
            except UnavailableError as exc:
                if not self.fallback:
                    raise
                log.info("fused loss unavailable, using the plain loss: %s", exc.message)
                self.chunk_size = 0
        return loss_sum(model, batch)


def token_logps(model, batch: dict, chunk_size: int = 0):
    """(model output, log-prob of each target token, fp32) in the order of ``with_target_positions``:
    what preference losses sum per sequence. chunk_size > 0: the fused head (no full logits)."""
    if chunk_size > 0:
        from onegpu.techniques.fused_loss import fused_token_logps

        out, h, y, head, amp = _target_hidden(model, batch)
        return out, fused_token_logps(head, h, y, chunk_size, amp)
    out = model(**model_inputs(batch))
    h, y = select_targets(out.logits, batch["labels"], batch.get(TARGETS))  # rows of logits, not hidden states
    return out, -F.cross_entropy(h.float(), y, reduction="none")


# ------------------------------------------------------------------------------- chunked loss
def _chunked_forward(model, batch: dict, chunk_size: int):
    from onegpu.techniques.fused_loss import fused_head_loss

    out, h, y, head, amp = _target_hidden(model, batch)
    return out, fused_head_loss(head, h, y, chunk_size, amp)


def _target_hidden(model, batch: dict):
    """Run the model keeping its final hidden states; return (output, hidden states of the positions
    that predict a target, those targets, the verified head, the autocast state)."""
    out, hidden, amp = _run_keeping_hidden(model, batch)
    head = _Head(model)
    head.verify(hidden[:, -1:], out.logits, amp)
    h, y = select_targets(hidden, batch["labels"], batch.get(TARGETS))
    return out, h, y, head, amp


def with_target_positions(batch: dict) -> dict:
    """The batch plus the flat positions whose next token is a target, computed here, on the host,
    before the batch is copied to the device: the fused loss then selects those rows without a
    device-to-host sync (a boolean-mask selection on a GPU waits for the count)."""
    labels = batch["labels"]
    b, t = (labels[:, 1:] != IGNORE).nonzero(as_tuple=True)
    return {**batch, TARGETS: b * labels.size(1) + t}


def select_targets(hidden: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None):
    """(hidden states, target tokens) of the positions that predict a target: row b*T+t of the
    flattened hidden states predicts label b*T+t+1."""
    if positions is None:
        positions = with_target_positions({"labels": labels})[TARGETS].to(labels.device)
    flat_h = hidden.reshape(-1, hidden.size(-1))
    return flat_h.index_select(0, positions), labels.reshape(-1).index_select(0, positions + 1)


def _run_keeping_hidden(model, batch: dict):
    """Run the model with only the last position's logits; return (output, final hidden states,
    the autocast state the forward ran under)."""
    captured = _capture_slot(model)
    try:
        try:
            out = model(**model_inputs(batch), logits_to_keep=1)
        except TypeError as exc:  # custom model code without the argument
            if "logits_to_keep" not in str(exc):
                raise
            raise UnavailableError(f"techniques.loss=fused: {type(model).__name__} cannot skip computing "
                                   "its full logits (no logits_to_keep argument).",
                                   hint="set techniques.loss=plain for this model") from None
        if "hidden" not in captured:
            raise UnavailableError(f"techniques.loss=fused: cannot reach the final hidden states of "
                                   f"{type(model).__name__}.", hint="set techniques.loss=plain for this model")
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
    return getattr(model, "module", model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class _Head:
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
            raise UnavailableError(f"techniques.loss=fused: {type(self.model).__name__} transforms its "
                                   "logits in a way the fused loss cannot reproduce.",
                                   hint="set techniques.loss=plain for this model")
        self.model._onegpu_head_verified = True
