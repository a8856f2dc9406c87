"""Activation memory, measured: the bytes a forward pass leaves alive for backward.

We run the real model code on CPU at the real widths but tiny batch/length, with a 1-layer and a
2-layer copy of the architecture, and count the tensor storages created during forward that are
still alive once it returns (saved for backward, or held by checkpointing). The difference of the
two copies is one decoder block, the rest is embedding + head + loss. Each is fitted as
``b * (a*s + q*s^2) + c`` over a few small (b, s) points and scaled to the real batch, length and
layer count. Matmul outputs are allocated but not computed (see _SkipMatmul), so even 70B-wide
blocks measure in seconds; weights come from ``to_empty`` and are never written.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
from dataclasses import asdict, astuple, dataclass

from onegpu.paths import cache_dir

log = logging.getLogger(__name__)

POINTS = ((1, 16), (1, 48), (1, 96), (2, 32), (2, 64), (4, 24))  # (batch, length) probes for the fit
MATMULS = ("mm.default", "addmm.default", "bmm.default", "baddbmm.default")


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

    def retained(self, batch: int, seq: int, layers: int, mode: str = "off", every: int = 2) -> float:
        """Bytes alive after forward for the whole model under a checkpointing mode."""
        n_ckpt = checkpointed_layers(layers, mode, every)
        per_ckpt = 0.0 if mode == "offload" else self.block_ckpt.at(batch, seq)
        return (self.base.at(batch, seq) + (layers - n_ckpt) * self.block.at(batch, seq)
                + n_ckpt * per_ckpt)

    def recompute_peak(self, batch: int, seq: int, mode: str) -> float:
        """Extra bytes while backward recomputes one checkpointed block."""
        return 0.0 if mode == "off" else self.block.at(batch, seq)


def checkpointed_layers(layers: int, mode: str, every: int = 2) -> int:
    """Layers that checkpoint: all (full/offload), every n-th starting at 0 (every-n), none (off).
    This is transformers' rule for ``activation_checkpointing_enable(every_n_layers=n)``."""
    if mode == "off":
        return 0
    if mode == "every-n":
        return len(range(0, layers, max(1, every)))
    return layers


class _Tracker:
    """Records every storage an op creates, to sum those still alive later."""

    def __init__(self, skip_matmul: bool):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = tracker._run(func, args, kwargs) if skip_matmul else func(*args, **kwargs)
                tracker._record(out)
                return out

        self.mode = Mode()
        self.refs: dict = {}

    def _run(self, func, args, kwargs):
        import torch
        from torch.utils import _pytree as pytree

        if func.__name__ == "_to_copy.default" and args[0].is_floating_point() and not kwargs.get("device"):
            # dtype casts (autocast's weight copies): allocate, don't convert; values never matter
            dtype = kwargs.get("dtype") or args[0].dtype
            if dtype.is_floating_point:
                return torch.empty_strided(args[0].shape, args[0].stride(), dtype=dtype, device=args[0].device)
        if func.__name__ not in MATMULS:
            return func(*args, **kwargs)
        # Same output shape, dtype and strides as the real kernel, without the FLOPs: the values
        # never matter for how many bytes are kept.
        meta = func(*pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args),
                    **pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), kwargs))
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device)

    def _record(self, out) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils import _pytree as pytree

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                self.refs[st._cdata] = (StorageWeakRef(st), st.nbytes())

    def alive(self, exclude: set) -> int:
        return sum(n for key, (ref, n) in self.refs.items() if key not in exclude and not ref.expired())


def retained_after_forward(model, batch: dict, loss_fn, autocast_dtype=None, skip_matmul: bool = False) -> int:
    """Bytes of tensors created by ``loss_fn(model, batch)`` that are alive after it returns
    (weights, buffers and the inputs excluded). Gradients are not computed."""
    import torch

    exclude = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    tracker = _Tracker(skip_matmul)
    amp = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    with amp, tracker.mode:
        loss = loss_fn(model, batch)
    alive = tracker.alive(exclude)
    del loss
    return alive


def prepare_like_training(model, mode: str = "off", every: int = 2, lora_rank: int = 0,
                          lora_targets: str = "all-linear"):
    """Training's own pipeline (techniques/prepare.py) with the settings that change what forward
    keeps: MoE router loss, LoRA adapters, checkpointing. Compile stays off: on CPU with matmuls
    skipped it would measure nothing real."""
    from onegpu.config import LoraConfig, TechniquesConfig
    from onegpu.techniques.prepare import prepare_model

    tcfg = TechniquesConfig(checkpointing=mode, checkpointing_every=every, compile="off",
                            lora=LoraConfig(enabled=bool(lora_rank), r=lora_rank or 16, targets=lora_targets))
    return prepare_model(model, tcfg, "cpu")


def activation_model(config, precision: str = "fp32", lora_rank: int = 0, chunk_size: int = 0,
                     attention: str = "sdpa", lora_targets: str = "all-linear") -> ActivationModel:
    """Measured activation model for an architecture (cached on disk by config and settings)."""
    key = _cache_key(config, precision, lora_rank, chunk_size, attention, lora_targets)
    path = cache_dir() / "activations" / f"{key}.json"
    if path.is_file():
        raw = json.loads(path.read_text())
        return ActivationModel(**{k: Fit(**v) for k, v in raw.items()})
    fits = {}
    for mode in ("off", "full"):
        one, two = (_fit(config, n, mode, precision, lora_rank, chunk_size, attention, lora_targets) for n in (1, 2))
        fits[mode] = (one, two)
    (off1, off2), (ck1, ck2) = fits["off"], fits["full"]
    model = ActivationModel(block=_sub(off2, off1), block_ckpt=_sub(ck2, ck1), base=_sub(_scale(off1, 2), off2))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"block": asdict(model.block), "block_ckpt": asdict(model.block_ckpt),
                                "base": asdict(model.base)}))
    return model


def _fit(config, layers: int, mode: str, precision: str, lora_rank: int, chunk_size: int, attention: str,
         lora_targets: str = "all-linear") -> Fit:
    import numpy as np

    model = build_probe_model(config, layers, precision, lora_rank, attention, mode, lora_targets)
    rows, ys = [], []
    for b, s in POINTS:
        rows.append([b * s, b * s * s, b, s, 1.0])
        ys.append(measure(model, b, s, precision, chunk_size, skip_matmul=True))
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys, dtype=float), rcond=None)
    return Fit(*map(float, coef))


def measure(model, batch: int, seq: int, precision: str, chunk_size: int = 0, skip_matmul: bool = False) -> int:
    """Retained bytes of one training forward (the project's loss function) at (batch, seq)."""
    import functools

    import torch

    from onegpu.techniques.loss import loss_sum

    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    amp = torch.bfloat16 if precision in ("fp16", "bf16") else None
    return retained_after_forward(model, data, functools.partial(loss_sum, chunk_size=chunk_size), amp, skip_matmul)


def build_probe_model(config, layers: int, precision: str = "fp32", lora_rank: int = 0, attention: str = "sdpa",
                      mode: str = "off", lora_targets: str = "all-linear"):
    """The architecture with ``layers`` decoder layers at full width, on CPU, weights uninitialised,
    prepared as training prepares it."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:layers]
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attention)
    model = model.to_empty(device="cpu")  # never written: untouched pages cost no RAM
    model.train()
    model = prepare_like_training(model, mode, 2, lora_rank, lora_targets)
    # The chunked loss checks once, by value, that it reproduces the model's logits; these weights
    # are uninitialised and the matmuls skipped, so only shapes are meaningful here.
    model._onegpu_head_verified = True
    return model


def _sub(a: Fit, b: Fit) -> Fit:
    return Fit(*(x - y for x, y in zip(astuple(a), astuple(b))))


def _scale(a: Fit, k: float) -> Fit:
    return Fit(*(x * k for x in astuple(a)))


def _cache_key(config, precision, lora_rank, chunk_size, attention, lora_targets="all-linear") -> str:
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    import torch
    import transformers

    parts = [text, precision, str(lora_rank), str(chunk_size), attention, lora_targets, repr(POINTS),
             torch.__version__, transformers.__version__]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
