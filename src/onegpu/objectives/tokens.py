"""The batch contract every objective shares, and the output head's per-token loss, fused or plain.

Losses are *sums* over target tokens (or pairs), so the step can normalise by the real count of the
whole accumulated batch (transformers#34191: per-micro-batch means weight tokens unevenly).

With ``chunk_size > 0`` the full-vocabulary logits are never materialised (transformers#30860): the
model runs with ``logits_to_keep=1`` and the output head + cross-entropy run fused, ``chunk_size``
tokens at a time (the method: techniques/fused_loss.py). ``TokenLoss`` is the one place that
chooses between the two and falls back from fused to plain.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from onegpu.errors import UnavailableError

log = logging.getLogger(__name__)

IGNORE = -100
TARGETS = "target_positions"  # batch key: see with_target_positions


# What a vision-language model's processor adds to a batch, by the names its forward takes
# (data/vision.VisionCollator): pixel values and their layout (Qwen2-VL's patch grid, Idefics3's
# pixel mask, LLaVA-NeXT's sizes) and Gemma 3's / Qwen2-VL's marks of the image tokens.
VISION_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_attention_mask",
    "token_type_ids",
    "mm_token_type_ids",
)
INPUTS = ("input_ids", "attention_mask", "position_ids", *VISION_INPUTS)


def model_inputs(batch: dict) -> dict:
    """Forward arguments for a loss computation. No KV cache: it is never read here, and its
    presence stops transformers from detecting packed documents."""
    inputs = {k: v for k, v in batch.items() if k in INPUTS}
    if "position_ids" in inputs:
        # Packed rows (padding-free): transformers separates the documents from the restarting
        # position_ids, but only when no 2-D attention mask is given.
        inputs.pop("attention_mask", None)
    inputs["use_cache"] = False
    return inputs


def with_target_positions(batch: dict) -> dict:
    """The batch plus the flat positions whose next token is a target, computed here, on the host,
    before the batch is copied to the device: the fused loss then selects those rows without a
    device-to-host sync (a boolean-mask selection on a GPU waits for the count)."""
    labels = batch["labels"]
    b, t = (labels[:, 1:] != IGNORE).nonzero(as_tuple=True)
    return {**batch, TARGETS: b * labels.size(1) + t}


def select_targets(
    hidden: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
):
    """(hidden states, target tokens) of the positions that predict a target: row b*T+t of the
    flattened hidden states predicts label b*T+t+1."""
    if positions is None:
        positions = with_target_positions({"labels": labels})[TARGETS].to(labels.device)
    flat_h = hidden.reshape(-1, hidden.size(-1))
    return flat_h.index_select(0, positions), labels.reshape(-1).index_select(0, positions + 1)


class TokenLoss:
    """The output head's loss over a batch's target tokens, from techniques.loss / loss_chunk_size:
    summed cross-entropy (``loss_sum``) or per-token log-probs (``token_logps``), fused when
    ``chunk_size > 0``.

    With loss=auto a model the fused head cannot serve (no logits_to_keep, logits it cannot
    reproduce) falls back to the plain loss on the first batch, once, with a log line, for every
    user of this object (the policy's loss and a reference alike); with loss=fused it is an error.
    ``verify=False`` skips the fused head's one check by value against the model's logits: for
    models whose weights are uninitialised (the planner measures shapes only).
    """

    def __init__(self, chunk_size: int = 0, fallback: bool = False, verify: bool = True):
        self.chunk_size, self.fallback, self.verify = chunk_size, fallback, verify

    @classmethod
    def for_run(
        cls, tcfg, vocab: int, on_gpu: bool, sharded: bool, verify: bool = True
    ) -> TokenLoss:
        from onegpu.errors import ConfigError
        from onegpu.techniques.fused_loss import fused_chunk

        if tcfg.loss == "fused" and sharded:
            raise ConfigError(
                "techniques.loss=fused needs the output head's weights whole in every process, "
                "but FSDP2 / DeepSpeed ZeRO-3 shards them.",
                hint="set techniques.loss=auto (or plain)",
            )
        return cls(
            fused_chunk(tcfg, vocab, on_gpu, sharded), fallback=tcfg.loss == "auto", verify=verify
        )

    @property
    def fused(self) -> bool:
        return self.chunk_size > 0

    def loss_sum(self, model, batch: dict):
        """(model output, summed next-token cross-entropy in fp32)."""
        return self._fused_or_plain(_fused_loss, _plain_loss, model, batch)

    def token_logps(self, model, batch: dict):
        """(model output, log-prob of each target token, fp32), in the order of
        ``with_target_positions``."""
        return self._fused_or_plain(_fused_logps, _plain_logps, model, batch)

    def policy_logps(self, model, batch: dict, temperature: float = 1.0):
        """(model output, log-prob of each target token under the logits / ``temperature``, the
        entropy of each of those distributions, no gradient): what a sampling policy's loss
        needs (GRPO), in the order of ``with_target_positions``."""
        fused = functools.partial(_fused_policy, temperature=temperature)
        plain = functools.partial(_plain_policy, temperature=temperature)
        out, (logps, entropy) = self._fused_or_plain(fused, plain, model, batch)
        return out, logps, entropy

    def _fused_or_plain(self, fused, plain, model, batch: dict):
        if self.chunk_size:
            try:
                return fused(model, batch, self.chunk_size, self.verify)
            except UnavailableError as exc:
                if not self.fallback:
                    raise
                log.info(
                    "fused head unavailable, using the plain loss (the model's logits): %s",
                    exc.message,
                )
                self.chunk_size = 0
        return plain(model, batch)


def _plain_loss(model, batch: dict):
    out = model(**model_inputs(batch))
    # Shift the labels, not the logits: slicing logits[:, :-1] would copy (tokens x vocab).
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE)
    logits = out.logits
    return out, F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def _plain_logps(model, batch: dict):
    out = model(**model_inputs(batch))
    h, y = select_targets(
        out.logits, batch["labels"], batch.get(TARGETS)
    )  # rows of logits, not hidden states
    return out, -F.cross_entropy(h.float(), y, reduction="none")


def _plain_policy(model, batch: dict, temperature: float):
    out = model(**model_inputs(batch))
    z, y = select_targets(out.logits, batch["labels"], batch.get(TARGETS))
    z = z.float() / temperature
    logps = -F.cross_entropy(z, y, reduction="none")
    with torch.no_grad():
        logp = F.log_softmax(z.detach(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return out, (logps, entropy)


def _fused_policy(model, batch: dict, chunk_size: int, verify: bool, temperature: float):
    from onegpu.techniques.fused_loss import fused_policy_logps

    out, h, y, head, amp = _target_hidden(model, batch, verify)
    return out, fused_policy_logps(head, h, y, chunk_size, amp, temperature)


def _fused_loss(model, batch: dict, chunk_size: int, verify: bool):
    from onegpu.techniques.fused_loss import fused_head_loss

    out, h, y, head, amp = _target_hidden(model, batch, verify)
    return out, fused_head_loss(head, h, y, chunk_size, amp)


def _fused_logps(model, batch: dict, chunk_size: int, verify: bool):
    from onegpu.techniques.fused_loss import fused_token_logps

    out, h, y, head, amp = _target_hidden(model, batch, verify)
    return out, fused_token_logps(head, h, y, chunk_size, amp)


def _target_hidden(model, batch: dict, verify: bool):
    """Run the model keeping its final hidden states; return (output, hidden states of the positions
    that predict a target, those targets, the verified head, the autocast state)."""
    from onegpu.techniques.fused_loss import Head, run_keeping_hidden

    out, hidden, amp = run_keeping_hidden(model, model_inputs(batch))
    head = Head(model)
    if verify:
        head.verify(hidden[:, -1:], out.logits, amp)
    h, y = select_targets(hidden, batch["labels"], batch.get(TARGETS))
    return out, h, y, head, amp
