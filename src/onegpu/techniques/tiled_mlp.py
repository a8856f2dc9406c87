"""Tiled MLP: each decoder layer's MLP runs over tiles of the sequence.

A Llama-family MLP keeps four (tokens x intermediate) tensors for its backward (the gate and up
projections, the activation, their product); at long sequences they are the largest activations
of a block, 4 x intermediate / hidden times its input (about 14x for Llama-3-8B). Tiled, the MLP
runs ``tile`` tokens at a time, each tile under a non-reentrant checkpoint: only the tile's input
(a view of the MLP input, which is kept anyway) is saved, and the tile's intermediates are
recomputed in its backward, so they never exist for more than one tile (the design of ALST's
TiledMLP, Arctic Long Sequence Training, and of Unsloth's and Axolotl's tiling). The cost is one
more MLP forward per step. The gradients are the plain MLP's: autograd sums each weight's tile
contributions before the weight's gradient is accumulated, once, as without tiling.

An MLP is tokenwise, so the tiles cut the flattened tokens (all rows of the micro-batch) into
pieces of ``techniques.tiled_mlp_tile_tokens`` (default: the hidden size, which makes a tile's
intermediate about the size of one MLP weight matrix). Under ``no_grad`` (evaluation) the tiles
run without the checkpoint: the full intermediate never exists there either.

``auto`` tiles a call whose sequence has at least ``techniques.tiled_mlp_min_seq`` tokens and runs
shorter ones as they are, so short-sequence runs pay nothing. Mixture-of-Experts blocks are left
whole: their routing and load-balancing loss are computed over the whole sequence.

Each tiled MLP's class becomes a subclass of its own (``TiledLlamaMLP`` of ``LlamaMLP``, one per
class, shared by every layer) whose forward runs the class's forward over the tiles: the module
tree, its parameters and state_dict keys stay the same, so PEFT, save_pretrained and compile see
the model as before, and regional compile sees the same code in every block (a per-instance
forward would be a different object in each, which compile guards on: one recompile a block, and
eager blocks past its recompile limit). ``untile`` puts each MLP's own class back.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Children that make an `mlp` a Mixture-of-Experts block (Qwen-MoE, Mixtral, gpt-oss, DeepSeek).
MOE_CHILDREN = {"experts", "router", "shared_expert", "shared_experts"}


class TiledMLP:
    """Placed before an MLP's own class (``tiled_class``): its forward is that class's forward,
    run over tiles of tokens (see the module docstring). ``onegpu_tiling`` (tile tokens, minimum
    sequence) is set on each instance."""

    onegpu_tiling: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        own = super().forward  # the MLP class's own forward
        tile_tokens, min_seq = self.onegpu_tiling
        tile = tile_tokens or x.shape[-1]
        if x.dim() < 2 or x.shape[-2] < min_seq or x.shape[:-1].numel() <= tile:
            return own(x)
        pieces = x.reshape(-1, x.shape[-1]).split(tile)
        if torch.is_grad_enabled():
            outs = [checkpoint(own, p, use_reentrant=False) for p in pieces]
        else:
            outs = [own(p) for p in pieces]
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])


_TILED: dict[type, type] = {}  # an MLP class -> its tiled subclass, made once


def tiled_class(cls: type) -> type:
    if cls not in _TILED:
        _TILED[cls] = type(f"Tiled{cls.__name__}", (TiledMLP, cls), {"__module__": __name__})
    return _TILED[cls]


def mlp_blocks(model) -> tuple[list, list]:
    """(MLP modules of the decoder layers that can be tiled, reasons for the layers that cannot)."""
    from onegpu.techniques.checkpointing import decoder_layers

    tileable, skipped = [], []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = dict(layer.named_children()).get("mlp")
        if mlp is None:
            skipped.append(f"layer {i} has no `mlp` submodule")
        elif MOE_CHILDREN & {name for name, _ in mlp.named_children()}:
            skipped.append(f"layer {i} is a Mixture-of-Experts block")
        else:
            tileable.append(mlp)
    return tileable, skipped


def apply_tiled_mlp(model, tcfg, seq_len: int | None = None):
    """Tile the decoder layers' MLPs according to ``tcfg.tiled_mlp``; returns the model.
    ``seq_len``: the run's longest sequence, so the log says whether tiles are used at it."""
    if tcfg.tiled_mlp == "off":
        return model
    tileable, skipped = mlp_blocks(model)
    if skipped:
        reasons = sorted({why.split(" ", 2)[2] for why in skipped})  # "layer 3 <reason>"
        log.info("tiled MLP: %d decoder layers left whole (%s)", len(skipped), "; ".join(reasons))
    min_seq = tcfg.tiled_mlp_min_seq if tcfg.tiled_mlp == "auto" else 1
    for mlp in tileable:
        if not isinstance(mlp, TiledMLP):  # prepared twice: tile once
            mlp.__class__ = tiled_class(type(mlp))
        mlp.onegpu_tiling = (tcfg.tiled_mlp_tile_tokens, min_seq)
    if tileable:
        log.info("tiled MLP: %s", tiling_line(len(tileable), tcfg, min_seq, seq_len))
    return model


def tiling_line(layers: int, tcfg, min_seq: int, seq_len: int | None) -> str:
    """What the tiling does to this run: an ``auto`` tiling installed on a run whose sequences are
    all shorter than its threshold never cuts a tile, and the start-up line must not suggest it
    does."""
    tile = tcfg.tiled_mlp_tile_tokens or "hidden-size"
    if seq_len is None:
        return (
            f"{layers} decoder layers run their MLP in tiles of {tile} tokens from {min_seq} "
            "tokens a sequence"
        )
    if seq_len < min_seq:
        return (
            f"no tiles at this sequence length: sequences of up to {seq_len} tokens are shorter "
            f"than techniques.tiled_mlp_min_seq={min_seq} (tiled_mlp=auto), so the {layers} "
            "decoder layers run their MLP whole"
        )
    return (
        f"tiles used at this sequence length: {layers} decoder layers run their MLP in tiles of "
        f"{tile} tokens on sequences of {min_seq} to {seq_len} tokens"
    )


def untile(model) -> None:
    """Put each MLP's own class back."""
    for mlp in mlp_blocks(model)[0]:
        if isinstance(mlp, TiledMLP):
            mlp.__class__ = type(mlp).__bases__[1]
            del mlp.onegpu_tiling
