"""Model shapes for planning: the HF config, and parameter counts from a model built on the meta
device (no memory, no download of weights)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

from onegpu.errors import ModelError


@dataclass
class ModelShape:
    name: str
    config: Any  # transformers PretrainedConfig
    params: int  # all parameters
    embed_params: int  # input embedding + untied output head (never quantized or adapted)
    linear_params: (
        int  # nn.Linear weights inside the decoder layers (what bnb quantizes, LoRA adapts)
    )
    lora_params_per_rank: int  # sum of (in + out) over those Linear layers: LoRA params = r x this
    expert_params: int  # parameters of MoE experts (only top_k / experts of them run per token)
    layers: int
    hidden: int
    heads: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    factored_elems: int = 0  # Adafactor state: rows + cols per matrix, all elements of vectors
    largest_param: int = 0  # elements of the biggest tensor (optimizer temporaries, ZeRO-3 buffers)
    lookup_params: int = (
        0  # nn.Embedding weights (token and position tables): looked up, not multiplied
    )
    lora_per_rank_by_name: dict = field(
        default_factory=dict
    )  # "q_proj" -> sum of (in + out) over such layers
    intermediate: int = 0  # the dense MLP's width (what a tiled MLP never holds whole); 0 = unknown
    # The decoder layers' Linear layers by shape: (name, in_features, out_features, count), the
    # output head left out; what FP8's rule and the planner's per-layer estimate read (plan/fp8.py)
    linears: tuple = ()
    lm_head: bool = True  # False: a reward model's score head in its place (model_shape)
    # a vision-language model's vision tower and projector (0 for a text model): frozen by default
    # (techniques.vision), so weights without gradients or optimizer state
    tower_params: int = 0
    projector_params: int = 0

    def lora_per_rank(self, targets: str = "all-linear") -> int:
        """LoRA parameters per unit of rank for lora.targets ("all-linear" or comma-separated
        names)."""
        if targets.strip() == "all-linear":
            return self.lora_params_per_rank
        names = {t.strip().rsplit(".", 1)[-1] for t in targets.split(",") if t.strip()}
        return sum(n for name, n in self.lora_per_rank_by_name.items() if name in names)

    @property
    def active_params(self) -> int:
        """Parameters a token's matmuls use (MoE: only its top_k experts): everything but the
        embedding tables, which are lookups. With tied embeddings the token table *is* the output
        head, a matmul every token pays for, so it counts once."""
        inactive = self.expert_params * (1 - self.top_k / self.experts) if self.experts else 0
        lookups = self.lookup_params or self.input_embed_params
        return int(self.params - inactive - lookups + (self.input_embed_params if self.tied else 0))

    @property
    def tied(self) -> bool:
        """The token table is also the output head (no head at all: not tied)."""
        return self.lm_head and self.embed_params == self.input_embed_params

    @property
    def input_embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """One forward's FLOPs per token (a no-grad pass, e.g. DPO's reference): 2N plus the attention
    matmuls."""
    return float(2 * shape.active_params + 4 * shape.layers * shape.hidden * seq_len)


def flops_per_token(
    shape: ModelShape,
    seq_len: int,
    lora_rank: int = 0,
    checkpointed_fraction: float = 0.0,
    lora_targets: str = "all-linear",
) -> float:
    """Training FLOPs per token, the one count behind the planner's speed and the benchmarks' MFU.

    Model FLOPs: 6N for the weight matmuls (forward 2N, backward 4N; N = active_params) plus the
    attention score/value matmuls, 12*L*h*s (PaLM appendix B; causal masking not discounted).
    LoRA skips the frozen weights' gradient matmuls (4N, plus 6 per adapter parameter). A
    checkpointed fraction of the blocks runs its forward once more in backward (2 FLOPs per block
    parameter and its attention forward; the head is never recomputed). The fused loss takes its
    gradients in the forward: nothing recomputed there.
    """
    n = shape.active_params
    attn_fwd = 4 * shape.layers * shape.hidden * seq_len  # QK^T and AV, 2 FLOPs per MAC
    if lora_rank:
        total = 4 * n + 6 * lora_rank * shape.lora_per_rank(lora_targets) + 2 * attn_fwd
    else:
        total = 6 * n + 3 * attn_fwd
    head = shape.vocab * shape.hidden  # parameters of the output head
    total += checkpointed_fraction * (2 * (n - head) + attn_fwd)
    return float(total)


def load_config(name: str, vocab_size: int = 4096, trust_remote_code: bool = False):
    """HF config for a preset (with the locally trained tokenizer's vocab size) or a model dir /
    id."""
    from transformers import AutoConfig, LlamaConfig

    from onegpu import models

    if models.is_preset(name):
        return LlamaConfig(
            **models.PRESETS[name],
            vocab_size=vocab_size,
            tie_word_embeddings=name in ("tiny", "small"),
        )
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot read the config of model '{name}': {str(exc).strip().splitlines()[0]}",
            hint=f"use a preset ({', '.join(models.PRESETS)}), a local model directory, "
            "or a Hub id while online",
        ) from None


# The causal LM a vision-language family's language model is (same layers, same activations; the
# multimodal rotary positions change no tensor's size), for the families whose text config has no
# causal-LM class of its own.
TEXT_TWINS = {
    "qwen2_vl_text": "Qwen2Config",
    "qwen2_5_vl_text": "Qwen2Config",
    "qwen3_vl_text": "Qwen3Config",
}


def language_config(config):
    """A vision-language model's language model as a causal LM's config (what the activation
    measurement builds); a text model's config unchanged."""
    from onegpu import vlm

    if not vlm.is_vision_config(config):
        return config
    text = config.get_text_config()
    twin = TEXT_TWINS.get(text.model_type)
    if twin is None:
        return text
    import transformers

    keys = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures")}
    return getattr(transformers, twin)(**keys)


def meta_model(config, score_head: bool = False):
    """The full model on the meta device: shapes and types only, no memory. ``score_head``: a
    reward model's (a one-output sequence-classification head in place of the LM head)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from onegpu import vlm

    with torch.device("meta"):
        if vlm.is_vision_config(config):
            return vlm.model_class().from_config(config)
        if score_head:
            config = copy.copy(config)
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config)
        return AutoModelForCausalLM.from_config(config)


def model_shape(
    name: str, vocab_size: int = 4096, trust_remote_code: bool = False, score_head: bool = False
) -> ModelShape:
    """The shape of model ``name``; ``score_head``: as a reward model (training.objective reward),
    whose parameters hold no LM head."""
    return _shape_of(name, load_config(name, vocab_size, trust_remote_code), score_head)


def _shape_of(name: str, config, score_head: bool = False) -> ModelShape:
    import torch

    model = meta_model(config, score_head)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        embed += head.weight.numel()
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed Linear

    tower, projector = _vision_params(model)
    linear, per_rank, by_name, shapes = 0, 0, {}, {}
    vision = tuple(n + "." for n in sum(vlm_modules(model), []))
    for module_name, mod in model.named_modules():
        if module_name.startswith(vision):  # LoRA goes on the language model (techniques.vision)
            continue
        if isinstance(mod, (torch.nn.Linear, Conv1D)) and mod is not head:
            linear += mod.weight.numel()
            per_rank += sum(mod.weight.shape)
            short = module_name.rsplit(".", 1)[-1]
            by_name[short] = by_name.get(short, 0) + sum(mod.weight.shape)
            if type(mod) is torch.nn.Linear:  # what float8 can replace (techniques/fp8.rule)
                key = (short, mod.in_features, mod.out_features)
                shapes[key] = shapes.get(key, 0) + 1
    experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)
    expert_params = (
        sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) if experts else 0
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    factored = sum(
        p.shape[-2] + p.shape[-1] if p.ndim >= 2 else p.numel() for p in model.parameters()
    )
    largest = max(p.numel() for p in model.parameters())
    lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return ModelShape(
        name,
        config,
        params,
        embed,
        linear,
        per_rank,
        expert_params,
        text.num_hidden_layers,
        text.hidden_size,
        text.num_attention_heads,
        text.vocab_size,
        experts,
        int(getattr(config, "num_experts_per_tok", 0) or 0),
        factored,
        largest,
        lookups,
        by_name,
        int(getattr(text, "intermediate_size", 0) or 0),
        tuple((*key, n) for key, n in shapes.items()),
        lm_head=head is not None,
        tower_params=tower,
        projector_params=projector,
    )


def vlm_modules(model) -> list[list[str]]:
    from onegpu import vlm

    if not vlm.is_vision_config(model.config):
        return [[], []]
    return list(vlm.vision_modules(model))


def _vision_params(model) -> tuple[int, int]:
    """(vision tower parameters, projector parameters) of a vision-language model; (0, 0) else."""
    tower, projector = vlm_modules(model)
    names = dict(model.named_modules())

    def count(roots, skip=()):
        seen = set()
        for r in roots:
            for n, _ in names[r].named_parameters(prefix=r):
                if not n.startswith(tuple(s + "." for s in skip)):
                    seen.add(n)
        return sum(p.numel() for n, p in model.named_parameters() if n in seen)

    return count(tower, projector), count(projector)


@functools.lru_cache(maxsize=16)
def cached_shape(
    name: str, vocab_size: int = 4096, trust_remote_code: bool = False, score_head: bool = False
) -> ModelShape:
    return model_shape(name, vocab_size, trust_remote_code, score_head)
