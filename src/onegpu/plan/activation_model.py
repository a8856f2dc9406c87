"""The activation model: bytes a forward leaves alive for backward as formulas of batch, length,
layer count and checkpointing mode (Fit, ActivationModel). Its coefficients are measured by
activations.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    """bytes(b, s) = b * (linear * s + quadratic * s^2 + per_row) + shared * s + const.

    per_row catches the shifted-by-one logits and labels (s - 1 tokens per row); shared catches
    tensors with one copy per position for the whole batch (rotary cos/sin)."""

    linear: float
    quadratic: float
    per_row: float
    shared: float
    const: float

    def at(self, batch: int, seq: int) -> float:
        per_row = self.linear * seq + self.quadratic * seq * seq + self.per_row
        return max(0.0, batch * per_row + self.shared * seq + self.const)


@dataclass(frozen=True)
class ActivationModel:
    block: Fit  # one decoder block, no checkpointing
    block_ckpt: Fit  # one checkpointed decoder block (what stays alive: its input)
    base: Fit  # embedding, final norm, head, logits and loss
    block_compiled: Fit | None = None  # one compiled block (see compiled_alive); None: as eager

    def retained(
        self,
        batch: int,
        seq: int,
        layers: int,
        mode: str = "off",
        every: int = 2,
        compiled: bool = False,
        not_kept: float = 0.0,
    ) -> float:
        """Bytes alive after forward for the whole model under a checkpointing mode. Compile is
        regional (the decoder blocks), so embedding, head and loss stay as eager code keeps them.
        ``not_kept``: bytes per block a method keeps no longer (a tiled MLP's intermediates)."""
        return self.base.at(batch, seq) + self.blocks(
            batch, seq, layers, mode, every, compiled, not_kept
        )

    def blocks(
        self,
        batch: int,
        seq: int,
        layers: int,
        mode: str = "off",
        every: int = 2,
        compiled: bool = False,
        not_kept: float = 0.0,
    ) -> float:
        """The decoder blocks' part of ``retained``: what activation offload moves to the host."""
        n_ckpt = checkpointed_layers(layers, mode, every)
        per_ckpt = 0.0 if mode == "offload" else self.block_ckpt.at(batch, seq)
        return (layers - n_ckpt) * self.block_at(batch, seq, compiled, not_kept) + n_ckpt * per_ckpt

    def block_at(
        self, batch: int, seq: int, compiled: bool = False, not_kept: float = 0.0
    ) -> float:
        """One block without checkpointing, less what a method keeps no longer."""
        return max(0.0, self._block(compiled).at(batch, seq) - not_kept)

    def recompute_peak(
        self, batch: int, seq: int, mode: str, compiled: bool = False, not_kept: float = 0.0
    ) -> float:
        """Extra bytes while backward recomputes one checkpointed block."""
        return 0.0 if mode == "off" else self.block_at(batch, seq, compiled, not_kept)

    def _block(self, compiled: bool) -> Fit:
        return self.block_compiled if compiled and self.block_compiled is not None else self.block


def checkpointed_layers(layers: int, mode: str, every: int = 2) -> int:
    """Layers that checkpoint: all (full/offload), every n-th starting at 0 (every-n), none (off).
    This is transformers' rule for ``activation_checkpointing_enable(every_n_layers=n)``."""
    if mode == "off":
        return 0
    if mode == "every-n":
        return len(range(0, layers, max(1, every)))
    return layers
