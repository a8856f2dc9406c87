"""Training memory at full model size, with no GPU: one optimizer step of a real-size model whose
weights, gradients, optimizer state and activations are fake tensors (shapes and dtypes, no data),
tracked by PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker``, against the planner's
prediction for the same setup (``plan.memory.estimate``, what ``onegpu plan`` shows).

The step is training's own: the model is built as ``from_pretrained`` builds it (weights dtype,
``attn_implementation="sdpa"``), prepared by ``techniques.prepare.prepare_model``, its optimizer by
``techniques.optimizers.build_optimizer``, its loss by ``objectives`` (SFT on a TokenLoss) and its
Accelerator by ``training.assemble.make_accelerator``; ``training.step.train_step`` runs the step.
Everything that builds those parts is in ``build`` (one place to follow changes to them).

Substitutions, each because fake tensors hold no values or this machine has no CUDA:
- the weights are fake CPU tensors (``to_empty`` inside a ``FakeTensorMode``), so autograd and
  CPU autocast run as they do on a card; the batch stays real (train_step counts its tokens on the
  host, as training does before copying a batch to the device);
- attention: transformers' SDPA call is routed as a CUDA card's dispatcher routes it (see
  ``CardAttention``: it replaces transformers' "sdpa" attention function while entered):
  half-precision inputs without a mask run ``aten._scaled_dot_product_flash_attention``; CUDA
  autocast casts SDPA's inputs to half, which CPU autocast does not, so the router casts them;
  anything else runs the composite op;
- the fused loss verifies its head against the model's logits by value, once per model: marked
  verified, as the planner's own measuring model is (plan/activations.build_probe_model);
- MemTracker's module hooks refuse the fused loss's calls of the output head (once per chunk,
  outside the model's forward, with ``torch.autograd.grad`` inside that forward):
  ``ModulesInModel`` leaves module calls made outside the model's forward out of the per-module
  hooks. Their memory is still counted (the tracker counts every allocation); only the module
  breakdown skips them;
- MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses: frozen
  parameters are entered as hooked already (``Tracker``);
- Accelerate keeps the fake weights where they are (``device_placement=False``): moving fake
  parameters between devices would swap them for real storage;
- fused SGD's in-place kernel has no fake implementation in torch 2.13 (fused AdamW's has), and
  FakeTensor's fallback would run it on real zero tensors of full size: it gets one that does
  nothing (``_fused_sgd_meta``), which is what it allocates on a card too;
- a value read from a fake tensor (``.item()``: Adafactor's relative step reads each weight's
  norm) is 1.0 (``_Values``): it scales an update, not a size.

MemTracker counts what the caching allocator would hand out, not what it reserves: the CUDA context,
the cuBLAS workspace and allocator rounding stay the planner's own additions (``reserved()``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import OrderedDict
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from onegpu.plan.candidate import Candidate, setup

GIB = 2**30
HALF = (torch.float16, torch.bfloat16)


def _llama(**kw):
    from transformers import LlamaConfig

    base = {
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
    }
    return LlamaConfig(**{**base, **kw})


def _qwen(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**kw)


def _mistral(**kw):
    from transformers import MistralConfig

    return MistralConfig(**kw)


def _mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(**kw)


# The published shapes (each model's config.json on the Hub), built with transformers' config
# classes: no download. Rope scaling and token ids do not change a byte of training memory.
def _preset(name: str):
    from onegpu.plan.arch import load_config

    return load_config(name)


SHAPES = {
    # onegpu's own preset, as the H100 run of 2026-11-25 trained it (vocab 4096, untied)
    "1b": lambda: _preset("1b"),
    "Llama-3.2-1B": lambda: _llama(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "Llama-3.2-3B": lambda: _llama(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "Llama-3.1-8B": lambda: _llama(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "Qwen2.5-7B": lambda: _qwen(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=131072,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "Mistral-7B-v0.3": lambda: _mistral(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
        max_position_embeddings=32768,
        rope_theta=1e6,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "Mixtral-8x7B": lambda: _mixtral(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Setup:
    """One row of the table: a published model shape, a planner candidate and a sequence length."""

    model: str  # a key of SHAPES
    candidate: Candidate
    seq: int
    layers: int = 0  # decoder layers; 0: the published depth

    @property
    def label(self) -> str:
        depth = f" {self.layers} layers" if self.layers else ""
        return f"{self.model}{depth} {self.candidate.label()} seq{self.seq}"

    def config(self):
        config = SHAPES[self.model]()
        if self.layers:
            config.num_hidden_layers = self.layers
        return config


class _CardSdpa(TorchFunctionMode):
    """SDPA as a CUDA card (sm80+) dispatches it: FlashAttention for half-precision inputs with no
    mask (GQA native, ``enable_gqa``), after autocast's cast of the inputs to half; the composite
    op (whatever this CPU picks) for anything else. Counts what it routed."""

    def __init__(self):
        super().__init__()
        self.flash = self.other = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        # CUDA autocast lists SDPA as a half-precision op; CPU autocast (the fake CPU weights
        # here) does not, and the cast happens below this mode either way: cast them here.
        for kind in ("cpu", "cuda"):
            if torch.is_autocast_enabled(kind):
                half = torch.get_autocast_dtype(kind)
                q, k, v = q.to(half), k.to(half), v.to(half)
        if (
            kwargs.get("attn_mask") is None
            and len(args) < 4
            and q.dtype in HALF
            and q.size(-1) <= 256
        ):
            self.flash += 1
            with torch.autocast("cpu", enabled=False):
                out = torch.ops.aten._scaled_dot_product_flash_attention(
                    q,
                    k,
                    v,
                    kwargs.get("dropout_p", 0.0),
                    kwargs.get("is_causal", False),
                    scale=kwargs.get("scale"),
                )
            return out[0]
        self.other += 1
        return func(q, k, v, *args[3:], **kwargs)


class CardAttention:
    """While entered, transformers' "sdpa" attention runs its SDPA call as a card routes it
    (``_CardSdpa``). Registered as the "sdpa" attention function, not as a mode around the step,
    so that checkpointing's recompute in backward (where a mode entered around the step is not
    active) routes the same way as the forward did."""

    def __init__(self):
        self.mode = _CardSdpa()

    @property
    def flash(self) -> int:
        return self.mode.flash

    @property
    def other(self) -> int:
        return self.mode.other

    def __enter__(self):
        from transformers import AttentionInterface

        self.plain = AttentionInterface._global_mapping["sdpa"]

        def routed(*args, **kwargs):
            with self.mode:
                return self.plain(*args, **kwargs)

        AttentionInterface.register("sdpa", routed)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface.register("sdpa", self.plain)


class _Values(TorchDispatchMode):
    """``.item()`` of a fake tensor reads 1.0 (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):
            dtype = args[0].dtype  # a check's condition (transformers' placeholder count) holds
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


def _is_fake(t) -> bool:
    """A fake tensor's value is unknown; a real one's (a VLM's image grid, read to lay out its
    positions) is read as it is."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class ModulesInModel(ModTracker):
    """ModTracker hooks only for the model and module calls inside its forward (see the module
    docstring: the fused loss calls the output head outside it)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.root = model, type(model).__name__

    def _outside(self, mod) -> bool:
        return not self.is_bw and mod is not self.model and self.root not in self.parents

    def _fw_pre_hook(self, mod, input):
        if not self._outside(mod):
            super()._fw_pre_hook(mod, input)

    def _fw_post_hook(self, mod, input, output):
        if not self._outside(mod):
            super()._fw_post_hook(mod, input, output)


class Tracker(MemTracker):
    """MemTracker with the two adjustments the module docstring names, keeping only the step's
    peak (the per-module peaks are never read here)."""

    def __init__(self, model):
        super().__init__()
        self._mod_tracker = ModulesInModel(model)
        none = OrderedDict()  # a handle over no hooks: removing it does nothing
        for p in model.parameters():
            if not p.requires_grad:  # never gets a gradient; a hook on it raises
                self._param_to_grad_hook_handles[p] = (RemovableHandle(none), RemovableHandle(none))

    def _update_peak_stats(self, peak_state) -> None:
        # MemTracker's own walks every tracked module at every op to keep per-module peaks: 57 of
        # a 1B LoRA step's 90 s on 2 cores. The step's peak, as MemTracker keeps it:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)


_LIBRARIES: list = []


def _fused_sgd_meta() -> None:
    """A do-nothing meta kernel for ``aten._fused_sgd_`` (see the module docstring), once."""
    if _LIBRARIES or torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_sgd_", "Meta"):
        return
    lib = torch.library.Library("aten", "IMPL")
    for name in ("_fused_sgd_", "_fused_sgd_.tensor_lr"):
        lib.impl(name, lambda *args, **kwargs: None, "Meta")
    _LIBRARIES.append(lib)  # the registration lasts as long as the Library object


def build(config, c: Candidate):
    """(model, optimizer, loss function, accelerator, run config) for a setup, built by training's
    own functions, with fake host weights. With ``meta_model`` and ``train_parts``, the only place
    the harness calls into the build path (a card's process uses the same two: card_offload.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from onegpu.config import Config
    from onegpu.hardware import DeviceInfo
    from onegpu.techniques.prepare import prepare_model

    _fused_sgd_meta()
    cfg = c.apply(Config())
    model = meta_model(config, c)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty unties them
    model = prepare_model(model.train(), cfg.techniques, "cuda")
    cpu = DeviceInfo(type="cpu", name="cpu", total_memory=0)  # where autocast runs
    return train_parts(model, config, cfg, cpu)


def meta_model(config, c: Candidate):
    """The model as from_pretrained builds it (the weights' dtype, sdpa), on the meta device."""
    from transformers import AutoModelForCausalLM

    from onegpu.techniques.precision import weights_dtype

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=weights_dtype(c.techniques.precision), attn_implementation="sdpa"
        )


def train_parts(model, config, cfg, device):
    """Optimizer, Accelerator (autocast for ``device``; the fake weights stay where they are) and
    SFT loss for a prepared model with fake weights: (model, optimizer, loss, accelerator, cfg)."""
    from onegpu.objectives.sft import SFT
    from onegpu.objectives.tokens import TokenLoss
    from onegpu.techniques.optimizers import build_optimizer
    from onegpu.training.assemble import make_accelerator

    optimizer = build_optimizer(model, cfg.techniques, cfg.training)
    accelerator = make_accelerator(cfg, device, cfg.techniques.precision)
    model, optimizer = accelerator.prepare(model, optimizer, device_placement=[False, False])
    # values are fake, so the fused head's one check by value is skipped: see the module docstring
    tokens = TokenLoss.for_run(cfg.techniques, config.vocab_size, True, False, verify=False)
    return model, optimizer, SFT(tokens), accelerator, cfg


def tracked(setup: Setup, route_sdpa: bool = True) -> dict:
    """One optimizer step after a warm one (optimizer state exists, gradients were freed by
    ``zero_grad(set_to_none=True)``), under MemTracker: its peak and the parts at that peak, bytes.
    ``route_sdpa=False``: SDPA as this machine runs it (its CPU kernels)."""
    from onegpu.training.step import train_step

    config, c = setup.config(), setup.candidate
    model, optimizer, loss_fn, accelerator, cfg = build(config, c)
    ids = torch.randint(
        0,
        config.vocab_size,
        (c.training.micro_batch_size, setup.seq),
        generator=torch.Generator().manual_seed(0),
    )
    micro = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    ] * c.training.grad_accum
    route = CardAttention()
    t0 = time.perf_counter()
    with route if route_sdpa else contextlib.nullcontext(), _Values():
        train_step(model, optimizer, micro, accelerator, cfg.training.max_grad_norm, loss_fn)
        tracker = Tracker(model)
        tracker.track_external(model, optimizer)
        with tracker:
            train_step(model, optimizer, micro, accelerator, cfg.training.max_grad_norm, loss_fn)
    seconds = time.perf_counter() - t0
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    parts = {str(k).split(".")[-1].lower(): v for k, v in snap.items()}
    out = {
        "peak": parts.pop("total"),
        "parts": parts,
        "seconds": seconds,
        "flash_calls": route.flash,
        "other_sdpa_calls": route.other,
        "optimizer_impl": _optimizer_impl(optimizer),
    }
    del model, optimizer, tracker
    gc.collect()
    return out


def _optimizer_impl(optimizer) -> str:
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    d = inner.defaults
    kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default"
    return f"{type(inner).__name__} ({kind})"


def predicted(setup: Setup) -> dict:
    """The planner's peak for the setup, bytes: the estimate ``onegpu plan`` makes on a GPU, with
    the attention kernel the planner measures for this model, and its parts."""
    from onegpu.config import Config
    from onegpu.plan import memory
    from onegpu.plan.arch import _shape_of
    from onegpu.techniques.attention import planning_attention

    config = setup.config()
    shape = _shape_of(setup.model, config)
    attention = planning_attention(Config().techniques, config)
    est = memory.estimate(shape, setup.candidate, setup.seq, on_gpu=True, attention=attention)
    return {
        "peak": est.peak,
        "parts": dict(est.components),
        "reserved": est.reserved(),
        "params": shape.params,
    }


def row(setup: Setup) -> dict:
    """Tracked and predicted peak of one setup, with the parts, in GiB, and their ratio."""
    t, p = tracked(setup), predicted(setup)
    return {
        "setup": setup.label,
        "model": setup.model,
        "candidate": setup.candidate.label(),
        "seq": setup.seq,
        "params": p["params"],
        "tracked_gib": t["peak"] / GIB,
        "predicted_gib": p["peak"] / GIB,
        "ratio": p["peak"] / t["peak"],
        "reserved_gib": p["reserved"] / GIB,
        "tracked_parts_gib": {k: v / GIB for k, v in t["parts"].items()},
        "predicted_parts_gib": {k: v / GIB for k, v in p["parts"].items()},
        "flash_calls": t["flash_calls"],
        "other_sdpa_calls": t["other_sdpa_calls"],
        "optimizer_impl": t["optimizer_impl"],
        "step_seconds": t["seconds"],
    }


TOLERANCE = 0.05  # the planner's peak within ±5% of the tracked one


def _setups() -> list[Setup]:
    from onegpu.techniques.fused_loss import auto_chunk

    def fused(model: str) -> int:  # the chunk loss=auto picks on a GPU for this vocabulary
        return auto_chunk(SHAPES[model]().vocab_size, on_gpu=True)

    def c(mb, accum, precision, checkpointing="off", optimizer="adamw", lora_rank=0, **more):
        lora = {"lora": {"r": lora_rank}} if lora_rank else {}
        return setup(
            mb,
            accum,
            precision=precision,
            checkpointing=checkpointing,
            optimizer=optimizer,
            **lora,
            **more,
        )

    in_bwd = {"optimizer_in_backward": True, "loss_chunk_size": fused("Llama-3.2-3B")}
    in_bwd_1b = {"optimizer_in_backward": True, "loss_chunk_size": fused("1b")}
    rows = [
        ("Llama-3.2-1B", c(2, 1, "bf16-pure"), 2048),
        ("Llama-3.2-1B", c(2, 1, "bf16", "full"), 2048),
        (
            "Llama-3.2-1B",
            c(4, 1, "bf16-pure", "every-n", loss_chunk_size=fused("Llama-3.2-1B")),
            2048,
        ),
        ("Llama-3.2-1B", c(4, 1, "bf16", "full", lora_rank=16), 2048),
        (
            "Llama-3.2-1B",
            c(2, 1, "bf16-pure", "full", "sgd", loss_chunk_size=fused("Llama-3.2-1B")),
            4096,
        ),
        ("Llama-3.2-3B", c(2, 1, "bf16-pure", "full", "adafactor"), 4096),
        ("Llama-3.2-3B", c(2, 1, "bf16", "every-n", loss_chunk_size=fused("Llama-3.2-3B")), 2048),
        # torchtune's 3B ladder (tests/torchtune_rows.py) without compile: the step in
        # backward, with torch's fused AdamW and with bitsandbytes' 8-bit one (its fake kernel)
        ("Llama-3.2-3B", c(2, 1, "bf16-pure", "full", "adamw", **in_bwd), 4096),
        ("Llama-3.2-3B", c(2, 1, "bf16-pure", "full", "adamw-8bit", **in_bwd), 4096),
        # bf16 autocast over fp32 weights, stepped in backward: the forward's end with autocast's
        # cached weight copies is the peak (plan/autocast_cache.py; an H100 measured 14.41, 8.91)
        ("1b", c(2, 1, "bf16", "full", "adamw", **in_bwd_1b), 4096),
        ("1b", c(2, 1, "bf16", "full", "adamw-8bit", **in_bwd_1b), 4096),
        ("Llama-3.1-8B", c(1, 1, "bf16-pure", "full", "sgd"), 4096),
        (
            "Llama-3.1-8B",
            c(2, 1, "bf16", "full", lora_rank=16, loss_chunk_size=fused("Llama-3.1-8B")),
            4096,
        ),
        (
            "Qwen2.5-7B",
            c(2, 1, "bf16-pure", "full", "adafactor", loss_chunk_size=fused("Qwen2.5-7B")),
            2048,
        ),
        ("Qwen2.5-7B", c(1, 1, "bf16", "off", lora_rank=16), 2048),
        ("Mistral-7B-v0.3", c(1, 1, "bf16-pure", "every-n"), 4096),
        ("Mistral-7B-v0.3", c(2, 1, "bf16", "full", "adafactor"), 2048),
        ("Mixtral-8x7B", c(1, 1, "bf16-pure", "off", lora_rank=16), 1024),
    ]
    return [Setup(m, cand, seq) for m, cand, seq in rows]


SETUPS = _setups()
# The cheapest rows (Llama-3.2-1B, all 16 layers; plain and fused loss, bf16 weights and mixed,
# checkpointing off / every-n / full, LoRA): the test tier runs these.
CHEAP = [SETUPS[0], SETUPS[2], SETUPS[3]]
