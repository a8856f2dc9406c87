"""The vision tower's and projector's activations: the bytes a training forward keeps of them for
backward, per training row (one example's images), measured as the language model's are
(activations.py): the real tower code at full width on CPU, weights uninitialised and matmuls
skipped, with a 1-layer and a 2-layer tower, prepared as training prepares it (techniques.vision,
LoRA, checkpointing), fed the processor's own pixel inputs for the images planned for.

What training does, and so what is counted:
- a frozen tower (the default) and a frozen projector keep nothing: none of their inputs or
  weights requires grad, and checkpointing leaves the tower out of backward
  (techniques/vision.no_gradient_to_pixels);
- a trained projector keeps its own inputs and intermediates (the tower's output among them);
- a trained tower (techniques.vision=all, or LoRA on it) keeps each layer's saved tensors, or with
  checkpointing each layer's input, as the language model's blocks do. transformers counts the
  tower's layers first when it checkpoints every n-th layer (they come first in the module tree).

Left out: compile (the tower is counted as eager code keeps it, which keeps at least as much), and
the tower's own working memory in its forward and its backward, which run before and after the
language model's and so beside none of its activations.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass

from onegpu.paths import cache_dir
from onegpu.plan.activation_model import checkpointed_layers


@dataclass(frozen=True)
class ImageLoad:
    """One training row's images as its processor makes them: the model inputs (pixel_values and
    whatever else the family reads: image_grid_thw, image_sizes, pixel_attention_mask) of the
    example with the most image tokens. Rows are planned as that example, as they are planned at
    data.seq_len tokens."""

    inputs: dict  # name -> tensor
    images: int

    def key(self) -> str:
        """What the bytes depend on: every input's shape, and the values of the small integer ones
        (an image grid, image sizes)."""
        parts = []
        for name in sorted(self.inputs):
            t = self.inputs[name]
            small = not t.is_floating_point() and t.numel() <= 64
            parts.append(f"{name}{tuple(t.shape)}{t.tolist() if small else ''}")
        return ";".join(parts)


@dataclass(frozen=True)
class VisionActs:
    """Bytes kept per row: a tower layer not checkpointed, a checkpointed one, and the rest (patch
    embedding, merger, projector) without and with checkpointing. The rest differs when the first
    layer's input needs no gradient (LoRA on a frozen patch embedding): the first layer saves less
    of it than the others, unless it checkpoints (every mode but off checkpoints layer 0)."""

    block: float
    block_ckpt: float
    base: float
    base_ckpt: float
    layers: int

    def retained(self, mode: str = "off", every: int = 2) -> float:
        n_ckpt = checkpointed_layers(self.layers, mode, every)
        per_ckpt = 0.0 if mode == "offload" else self.block_ckpt
        base = self.base if mode == "off" else self.base_ckpt
        return max(0.0, base + (self.layers - n_ckpt) * self.block + n_ckpt * per_ckpt)


def vision_bytes(shape, c, rows: int, images: ImageLoad | None) -> float:
    """What ``rows`` training rows of candidate ``c`` keep of a vision-language model's tower and
    projector for backward, each row holding ``images``; 0 for a text model or no images. They are
    alive from the forward's start to the backward's end (plan/memory.py adds them to both)."""
    if images is None or not shape.tower_params:
        return 0.0
    t = c.techniques
    acts = vision_activations(shape.config, t, images)
    return rows * acts.retained(t.checkpointing, t.checkpointing_every)


def load_for(processor, images: list, data_cfg=None) -> ImageLoad:
    """The ImageLoad of ``images`` (PIL images), by the processor's own image processor and the
    run's resolution settings (data.max_pixels / min_pixels)."""
    from onegpu.data.vision import image_kwargs

    kwargs = image_kwargs(processor, data_cfg) if data_cfg is not None else {}
    out = processor.image_processor(images=images, return_tensors="pt", **kwargs)
    return ImageLoad({k: v for k, v in dict(out).items() if hasattr(v, "shape")}, len(images))


def tower_depth(vision_config) -> int:
    """The tower's layer count under the name its family uses (Qwen: depth; CLIP, SigLIP: ...)."""
    for key in ("depth", "num_hidden_layers"):
        if isinstance(getattr(vision_config, key, None), int):
            return getattr(vision_config, key)
    raise ValueError(f"{type(vision_config).__name__} names no layer count")


def vision_activations(config, techniques, load: ImageLoad) -> VisionActs:
    """The measured VisionActs of a vision-language ``config`` for ``load`` under a settled
    TechniquesConfig (cached on disk by config, settings and the images' inputs)."""
    from onegpu.plan.activations import measured_settings

    settings = (*measured_settings(techniques), techniques.vision)
    key = _cache_key(config, load, settings)
    path = cache_dir() / "vision-activations" / f"{key}.json"
    if path.is_file():
        return VisionActs(**json.loads(path.read_text()))
    (off1, off2), (ck1, ck2) = (
        [_measure(config, techniques, load, n, mode) for n in (1, 2)] for mode in ("off", "full")
    )
    acts = VisionActs(
        block=off2 - off1,
        block_ckpt=ck2 - ck1,
        base=2 * off1 - off2,
        base_ckpt=2 * ck1 - ck2,
        layers=tower_depth(config.vision_config),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(acts)))
    return acts


def _measure(config, techniques, load: ImageLoad, layers: int, mode: str) -> int:
    import torch

    from onegpu.plan.activations import measured_settings, retained_after_forward

    precision = measured_settings(techniques)[0]
    model = probe_model(config, techniques, layers, mode)
    amp = torch.bfloat16 if precision in ("fp16", "bf16") else None
    kept = retained_after_forward(model, dict(load.inputs), image_features_sum, amp, True)
    return kept - 4  # the summed features: a float32 scalar, not something training keeps


def image_features_sum(model, inputs: dict):
    """The image features the language model would receive, summed (a sum keeps nothing for
    backward, as the scatter of the features into the token embeddings keeps nothing of them)."""
    import inspect

    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    get = base.model.get_image_features
    names = inspect.signature(get).parameters
    out = get(**{k: v for k, v in inputs.items() if k in names})
    feats = getattr(out, "pooler_output", None)
    feats = out if feats is None else feats
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1) for f in feats])
    return feats.sum(dtype=torch.float32)


def probe_model(config, techniques, layers: int, mode: str):
    """The model with a ``layers``-layer tower and a 1-layer language model at full width, on CPU,
    weights uninitialised, prepared as training prepares it."""
    import torch

    from onegpu import vlm
    from onegpu.plan.activations import measured_settings, prepare_like_training

    cfg = copy.deepcopy(config)
    for key in ("depth", "num_hidden_layers"):
        if isinstance(getattr(cfg.vision_config, key, None), int):
            setattr(cfg.vision_config, key, layers)
    text = cfg.text_config
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    precision, rank, _, targets, lora_dtype, *_ = measured_settings(techniques)
    dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    from transformers.initialization import no_init_weights

    # Built on CPU without initialising the weights (untouched pages cost no RAM), not on meta
    # and emptied: the towers' position ids are buffers made at construction, and index tables.
    with no_init_weights():
        model = vlm.model_class().from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.train()
    return prepare_like_training(
        model, mode, 2, rank, targets, lora_dtype, vision=techniques.vision
    )


def _cache_key(config, load: ImageLoad, settings: tuple) -> str:
    import torch
    import transformers

    parts = [
        config.to_json_string(use_diff=False),
        load.key(),
        *map(str, settings),
        "vision-v3",
        torch.__version__,
        transformers.__version__,
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
