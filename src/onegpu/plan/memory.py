"""Peak training memory by component: weights, gradients, optimizer state, activations, logits and
loss, optimizer temporaries, allocator overhead.

Everything except activations follows from parameter counts and dtypes; activations come from
the measured model in activations.py. Figures are bytes as torch.cuda.max_memory_allocated would
report them; ``fits`` adds the allocator's fragmentation and the CUDA context on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onegpu.plan.activation_model import ActivationModel, checkpointed_layers
from onegpu.plan.activations import activation_model
from onegpu.plan.arch import ModelShape
from onegpu.plan.autocast_cache import forward_end_bytes
from onegpu.plan.candidate import Candidate
from onegpu.plan.fp8 import cast_transient_bytes
from onegpu.plan.reward_models import reward_model_bytes
from onegpu.plan.transients import act_bytes, loss_transient_bytes, param_bytes, rollout_bytes
from onegpu.plan.vision import ImageLoad, vision_bytes

GIB = 2**30
CUDA_CONTEXT = 0.6 * GIB  # driver context + cuBLAS/cuDNN handles: outside torch's allocator counts
FRAGMENTATION = 0.05  # caching allocator: reserved exceeds allocated by a few % in steady state

# Optimizer state per trainable parameter, in units of the parameter's own size (torch AdamW keeps
# exp_avg and exp_avg_sq in the parameter dtype) or in absolute bytes for quantized states.
STATE_RELATIVE = {"adamw": 2.0, "adamw-foreach": 2.0, "adamw-fused": 2.0, "sgd": 1.0}
STATE_BYTES = {
    "adamw-8bit": 2.0 + 8 / 256,  # bitsandbytes blockwise: 2 states x 1 B + fp32 absmax per 256
    "paged-adamw-8bit": 2.0 + 8 / 256,
    "adamw-8bit-ao": 2.0 + 8 / 256,  # torchao: block size 256
    "adamw-4bit-ao": 1.0 + 8 / 128,  # torchao: two 4-bit states, block size 128
}
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + double-quantized absmax per 64 weights
INT8_BYTES = 1.0  # LLM.int8: int8 weights (+ a per-row fp32 scale, negligible)


@dataclass
class MemoryEstimate:
    components: dict = field(default_factory=dict)  # name -> bytes, at the peak
    peak: float = 0.0  # bytes allocated at the peak
    host_activations: float = 0.0  # bytes activation offload holds in pinned host memory

    def reserved(self) -> float:
        """What the GPU must hold: the allocator's fragmentation and the CUDA context on top."""
        return self.peak * (1 + FRAGMENTATION) + CUDA_CONTEXT

    def fits(self, capacity_bytes: float) -> bool:
        return self.reserved() <= capacity_bytes


def trained_bytes(c: Candidate) -> int:
    """Bytes per trainable parameter: the adapters' dtype under LoRA, else the weights'."""
    return adapter_bytes(c) if c.lora_rank else param_bytes(c.techniques.precision)


def weight_bytes(shape: ModelShape, c: Candidate) -> float:
    """Resident model weights (frozen quantized base + adapters for QLoRA)."""
    t = c.techniques
    pb = param_bytes(t.precision)
    if t.offload == "zero3-cpu":  # only the gathered layer (and the prefetched next) in 16-bit
        return 2 * shape.largest_param * 2
    if t.offload == "zero2-cpu":  # 16-bit working copy; fp32 master lives with the optimizer
        return shape.params * 2
    base = shape.params * pb
    if c.quantize_base in ("nf4", "fp4", "int8"):
        per = NF4_BYTES if c.quantize_base != "int8" else INT8_BYTES
        rest_bytes = 2 if t.precision in ("fp16", "bf16", "bf16-pure") else 4
        base = shape.linear_params * per + (shape.params - shape.linear_params) * rest_bytes
    return base + lora_params(shape, c) * adapter_bytes(c)


def adapter_bytes(c: Candidate) -> int:
    """Bytes per adapter parameter, and so per adapter gradient and AdamW state element."""
    return 2 if c.adapter_dtype == "bf16" else 4


def lora_params(shape: ModelShape, c: Candidate) -> int:
    return c.lora_rank * shape.lora_per_rank(c.techniques.lora.targets)


def trainable_params(shape: ModelShape, c: Candidate) -> int:
    if c.lora_rank:
        return lora_params(shape, c)
    return shape.params - frozen_vision_params(shape, c)


def frozen_vision_params(shape: ModelShape, c: Candidate) -> int:
    """A vision-language model's parameters techniques.vision keeps frozen (full fine-tuning)."""
    mode = c.techniques.vision
    return {
        "frozen": shape.tower_params + shape.projector_params,
        "projector": shape.tower_params,
        "all": 0,
    }[mode]


def grad_bytes(shape: ModelShape, c: Candidate) -> float:
    t = c.techniques
    if t.optimizer_in_backward:  # each gradient is applied and freed as soon as it is complete
        return min(trainable_params(shape, c), shape.largest_param) * trained_bytes(c)
    if c.lora_rank:
        return lora_params(shape, c) * adapter_bytes(c)
    if t.offload != "none":
        return shape.params * 2 if t.offload == "zero2-cpu" else 2 * shape.largest_param * 2
    return trainable_params(shape, c) * param_bytes(t.precision)


# state in CUDA unified memory: outside the caching allocator, spills to host
PAGED = ("paged-adamw-8bit",)


def optimizer_bytes(shape: ModelShape, c: Candidate, on_gpu: bool = True) -> float:
    """Optimizer state in the device's caching allocator (none under ZeRO offload, which keeps it in
    host memory, nor for a paged optimizer on a GPU, whose state is host-backed unified memory)."""
    if c.techniques.offload != "none" or paged_bytes(shape, c, on_gpu):
        return 0.0
    return state_bytes(shape, c)


def paged_bytes(shape: ModelShape, c: Candidate, on_gpu: bool = True) -> float:
    """Host-backed optimizer state of a paged optimizer (bitsandbytes' cudaMallocManaged pages;
    off a GPU it trains as the plain 8-bit optimizer, in ordinary memory)."""
    t = c.techniques
    return state_bytes(shape, c) if on_gpu and t.optimizer in PAGED and t.offload == "none" else 0.0


def state_bytes(shape: ModelShape, c: Candidate) -> float:
    """Bytes of optimizer state wherever it lives."""
    n = trainable_params(shape, c)
    pb, opt = trained_bytes(c), c.techniques.optimizer
    if opt == "adafactor":  # factored second moment, no first moment (transformers' defaults)
        if not c.lora_rank:
            return shape.factored_elems * pb
        return (shape.lora_per_rank(c.techniques.lora.targets) + 2 * c.lora_rank) * pb
    if opt in STATE_BYTES:
        return n * STATE_BYTES[opt]
    return n * pb * STATE_RELATIVE.get(opt, 2.0)


# Bytes per element of the largest trained tensor that a per-tensor step allocates beyond its
# state, (GPU, CPU). CPU: measured from allocator events (tests/test_plan_memory.py). GPU: the
# buffers of inductor's Triton code for sm90 (benchmarks/results/optimizer-step-buffers.md):
# torchao's 8-bit step is one fused kernel with none, the 4-bit one writes fp32 moments and int64
# codes before packing; bitsandbytes' CUDA kernel works in place, its CPU one on fp32 copies.
STEP_TEMP_PER_ELEMENT = {"adamw-8bit-ao": (0.0, 8.0), "adamw-4bit-ao": (24.0, 26.0)}
STEP_TEMP_PER_ELEMENT |= dict.fromkeys(("adamw-8bit", "paged-adamw-8bit"), (0.0, 20.0))


def optimizer_temp_bytes(shape: ModelShape, c: Candidate, on_gpu: bool) -> float:
    """Temporaries of optimizer.step(). None in place: fused AdamW (onegpu's adamw on a GPU and,
    since torch 2.4, on CPU) and fused SGD (on the simulated card, as bitsandbytes' 8-bit kernel,
    the step of Llama-3.2-3B's embedding holds nothing beyond its gradient). foreach AdamW builds
    whole-model intermediate lists; Adafactor one tensor's variance estimate; the per-tensor
    steps above their largest tensor's."""
    n = trainable_params(shape, c)
    opt = c.techniques.optimizer
    largest = min(n, shape.largest_param)
    if c.techniques.offload != "none":
        return 0.0
    if opt == "adamw-foreach":
        return n * trained_bytes(c)
    if opt == "adafactor":  # one tensor at a time: its full-size variance estimate, then update
        return largest * trained_bytes(c)
    if opt in STEP_TEMP_PER_ELEMENT:
        return largest * STEP_TEMP_PER_ELEMENT[opt][0 if on_gpu else 1]
    return 0.0


def activations(
    shape: ModelShape,
    c: Candidate,
    seq_len: int,
    acts: ActivationModel | None = None,
    attention: str = "sdpa",
    on_gpu: bool = True,
    vision: float = 0.0,
) -> tuple[float, float, float, float]:
    """(device bytes kept for backward, extra device bytes during backward, bytes waiting in pinned
    host memory under activation offload, off a GPU already in host memory where they stay;
    activation bytes while the backward is in the first block: ``first_block_bytes``).
    ``vision``: the vision tower's and projector's bytes for these rows (``vision_bytes``)."""
    t = c.techniques
    seq_len = c.sequence_tokens(seq_len)  # GRPO: prompt and completion
    acts = acts or activation_model(shape.config, t, attention)
    # compiled: elementwise intermediates recomputed (activations.py; an assumption)
    compiled = t.compile != "off"
    # a preference pair: chosen and rejected
    rows = c.training.micro_batch_size * c.rows_per_example
    mode, every = t.checkpointing, t.checkpointing_every
    tiled = mlp_tiled(shape, c, seq_len)
    not_kept = mlp_saved_bytes(shape, c, rows * seq_len) if tiled else 0.0
    not_kept += quantized_cast_bytes(shape, c)
    kept = acts.retained(rows, seq_len, shape.layers, mode, every, compiled, not_kept)
    # Not at the same time: the loss's peak is over (its gradients freed, or, fused, inside the
    # forward) before backward reaches the blocks, where a recomputed or reloaded block peaks.
    loss = loss_transient_bytes(shape, c, rows * seq_len)
    transient = acts.recompute_peak(rows, seq_len, mode, compiled, not_kept)
    transient += cast_transient_bytes(shape, c, rows * seq_len)  # eager float8 layers' backward
    if tiled:  # one tile's intermediates, and their gradients, exist at a time
        transient += 2 * mlp_saved_bytes(shape, c, min(tile_tokens(shape, c), rows * seq_len))
    first = first_block_bytes(shape, c, rows, seq_len, acts, compiled, not_kept, tiled)
    # the tower's and projector's, alive from the forward's start to the backward's end
    kept, first = kept + vision, first + vision
    host = 0.0
    if on_gpu and t.activation_offload and offloaded(shape, c, rows * seq_len):
        # Every block's saved tensors wait in host memory; on the device stay the embedding, head
        # and loss part, the copies in flight (techniques/activation_offload.py bounds them) and,
        # in backward, the block whose saved tensors are back (a checkpointed one: its input,
        # beside the recomputed block already counted).
        # Left out (so it keeps more: 96 MiB at Llama-3.2-1B 2x4096, tests/simgpu/card_offload.py):
        # the head's saved inputs move too, and they are the copies in flight at the forward's end.
        from onegpu.techniques.activation_offload import MAX_IN_FLIGHT, PREFETCH

        host = acts.blocks(rows, seq_len, shape.layers, mode, every, compiled, not_kept)
        n_ckpt = checkpointed_layers(shape.layers, mode, every)
        storage = largest_saved(shape, c, rows * seq_len, tiled, n_ckpt == shape.layers)
        kept = kept - host + min(host, MAX_IN_FLIGHT * storage)
        back = (
            acts.block_ckpt.at(rows, seq_len)
            if n_ckpt == shape.layers
            else acts.block_at(rows, seq_len, compiled, not_kept)
        )
        transient += back + PREFETCH * storage
    return kept, max(transient, loss), host, first


def first_block_bytes(
    shape: ModelShape,
    c: Candidate,
    rows: int,
    seq_len: int,
    acts: ActivationModel,
    compiled: bool,
    not_kept: float,
    tiled: bool,
) -> float:
    """Activation bytes when the backward is inside the first decoder block, its last: that
    block's saved tensors (kept, or recomputed beside its checkpointed input) and its MLP's
    backward intermediates: the gradient of the gated product, then those of the gate and up
    projections together (tokens x intermediate each), beside the incoming hidden gradient. With
    every gradient but the first block's and the input embedding's made by then, this is the
    backward's other end (``late_backward_bytes``)."""
    tokens = rows * seq_len
    first = acts.block_at(rows, seq_len, compiled, not_kept)
    if c.techniques.checkpointing != "off":  # block 0 checkpoints in every mode (every-n from 0)
        first += acts.block_ckpt.at(rows, seq_len)
    mlp_tokens = min(tile_tokens(shape, c), tokens) if tiled else tokens
    return first + (3 * mlp_tokens * shape.intermediate + tokens * shape.hidden) * act_bytes(c)


def late_backward_bytes(shape: ModelShape, c: Candidate, first_block: float) -> float:
    """Device bytes above weights and optimizer state when the backward reaches the first block:
    every gradient made so far and that block's activations. Without accumulation, that is all
    gradients but the first block's and the input embedding's; a tied output head's gradient is
    there (autograd holds it until the embedding's part is added: the same size), an untied
    one's too. Accumulating, all gradients exist throughout; stepped in backward, or LoRA, they
    are small."""
    t = c.techniques
    g = grad_bytes(shape, c)
    if c.training.grad_accum > 1 or t.optimizer_in_backward or c.lora_rank or t.offload != "none":
        return g + first_block
    pb = param_bytes(t.precision)
    block = (shape.params - shape.embed_params) / max(shape.layers, 1) * pb
    embedding = 0 if shape.tied else shape.input_embed_params * pb
    return g - block - embedding + first_block


def quantized_cast_bytes(shape: ModelShape, c: Candidate) -> float:
    """Per block, what the measured model keeps that a quantized base does not. The activation
    model is measured on an unquantized copy, whose autocast keeps a 16-bit copy of each frozen
    Linear weight for its input's gradient; bitsandbytes' 4-bit and 8-bit matmuls save the packed
    weight (already counted with the weights) and dequantize it again in backward."""
    autocast = c.techniques.precision in ("fp16", "bf16")  # bf16-pure weights need no cast
    if c.quantize_base == "none" or not autocast or not shape.layers:
        return 0.0
    return shape.linear_params / shape.layers * 2


def mlp_tiled(shape: ModelShape, c: Candidate, seq_len: int) -> bool:
    """Whether training runs this setup's MLPs over token tiles (techniques/tiled_mlp.py): on, or
    auto from tiled_mlp_min_seq tokens per row; never an MoE block, nor a call of one tile or less.
    """
    t = c.techniques
    wanted = t.tiled_mlp == "on" or (t.tiled_mlp == "auto" and seq_len >= t.tiled_mlp_min_seq)
    tokens = c.training.micro_batch_size * c.rows_per_example * seq_len
    return (
        wanted and not shape.experts and shape.intermediate > 0 and tokens > tile_tokens(shape, c)
    )


def mlp_tokens(shape: ModelShape, c: Candidate, seq_len: int) -> int:
    """Tokens one MLP call runs at once: a tile's when tiled, else the micro-batch's."""
    seq = c.sequence_tokens(seq_len)
    tokens = c.training.micro_batch_size * c.rows_per_example * seq
    return min(tile_tokens(shape, c), tokens) if mlp_tiled(shape, c, seq) else tokens


def tile_tokens(shape: ModelShape, c: Candidate) -> int:
    return c.techniques.tiled_mlp_tile_tokens or shape.hidden


def mlp_saved_bytes(shape: ModelShape, c: Candidate, tokens: int) -> float:
    """What one block's MLP keeps for backward over ``tokens``: the gate and up projections, the
    activation and their product (tokens x intermediate each); compiled code keeps only the two
    matmul outputs and recomputes the elementwise ones (activations.py)."""
    tensors = 2 if c.techniques.compile != "off" else 4
    return tensors * tokens * shape.intermediate * act_bytes(c)


def offloaded(shape: ModelShape, c: Candidate, tokens: int) -> bool:
    """Whether the blocks' saved tensors reach activation_offload_min_bytes: a block input (tokens x
    hidden) is the smallest of them that matters; smaller ones stay, and so do the rest (assumed:
    a block's saved tensors are all at least that size)."""
    return tokens * shape.hidden * act_bytes(c) >= c.techniques.activation_offload_min_bytes


def largest_saved(
    shape: ModelShape, c: Candidate, tokens: int, tiled: bool, all_ckpt: bool
) -> float:
    """Bytes of the largest storage a block saves: its input under checkpointing, else an MLP
    intermediate (tokens x intermediate) unless the MLP is tiled."""
    width = shape.hidden if all_ckpt or tiled else max(shape.hidden, shape.intermediate)
    return tokens * width * act_bytes(c)


def estimate(
    shape: ModelShape,
    c: Candidate,
    seq_len: int,
    on_gpu: bool = True,
    acts: ActivationModel | None = None,
    attention: str = "sdpa",
    images: ImageLoad | None = None,
) -> MemoryEstimate:
    """Peak bytes of one optimizer step.

    The peak is either late in forward / early in backward (activations, plus gradients already
    held from earlier micro-batches when accumulating), at the backward's last block (nearly every
    gradient, one block's activations) or in optimizer.step() (all gradients and the optimizer's
    temporaries); weights and optimizer state are there throughout.
    """
    # measured once (plan/vision.py reads its disk cache): inside the activations, shown apart
    seen = vision_bytes(shape, c, c.training.micro_batch_size * c.rows_per_example, images)
    kept, transient, host, first = activations(shape, c, seq_len, acts, attention, on_gpu, seen)
    w, g, o = (
        weight_bytes(shape, c),
        grad_bytes(shape, c),
        optimizer_bytes(shape, c, on_gpu),
    )
    temp = optimizer_temp_bytes(shape, c, on_gpu)
    held_grads = g if c.training.grad_accum > 1 else 0.0
    # The backward's two ends: its start (all activations, the loss's or a block's transient)
    # and its last block (nearly all gradients made); between them one grows as the other falls.
    early, late = kept + transient + held_grads, late_backward_bytes(shape, c, first)
    # A third point under autocast: the forward's end, with the cache's 16-bit weight copies
    # (autocast_cache.py); the backward starts after the cache is emptied.
    forward_end = forward_end_bytes(
        shape, c, kept, mlp_tokens(shape, c, seq_len), act_bytes(c), lora_params(shape, c)
    )
    backward_peak = max(early, late, forward_end + held_grads)
    step_peak = g + temp
    comps = {
        "weights": w,
        "optimizer": o,
        "gradients": g,
        "activations": kept,
        "backward transient": transient,
        "optimizer temporaries": temp,
    }
    if late > early and late >= forward_end:  # the activations at that moment: the first block's
        comps["activations"], comps["backward transient"] = first, 0.0
    elif forward_end > early:  # beside the kept activations: the cached copies, the last MLP's
        comps["backward transient"] = 0.0
        comps["autocast weight copies and last MLP (forward)"] = forward_end - kept
    if seen:  # shown apart from the language model's (inside the activations above)
        comps["activations"] -= seen
        comps["vision tower and projector activations"] = seen
    if c.reference_kind == "copy":  # DPO's frozen reference: the whole model again, weights' dtype
        comps["reference copy"] = shape.params * param_bytes(c.techniques.precision)
        w += comps["reference copy"]
    peak = max(backward_peak, step_peak)
    if c.training.objective == "grpo":  # sampling: weights and optimizer state, no gradients
        comps["rollout KV cache and sampling logits"] = rollout_bytes(shape, c, seq_len)
        peak = max(peak, comps["rollout KV cache and sampling logits"])
        scorer = reward_model_bytes(c, seq_len, on_gpu)
        if scorer is not None:  # resident from the first scoring on; its forward a moment apart
            comps["reward model weights"] = scorer.weights
            comps["reward model scoring"] = scorer.scoring
            w += scorer.weights
            peak = max(peak, scorer.scoring)
    if host:  # shown, but not in the device peak
        comps["offloaded activations (pinned host)"] = host
    if paged_bytes(shape, c, on_gpu):  # shown, not in the peak: outside the allocator, pages out
        comps["paged optimizer state (host-backed)"] = paged_bytes(shape, c, on_gpu)
    return MemoryEstimate(comps, w + o + peak, host)
