"""Typed run configuration: one dataclass per concern, loaded from YAML and/or the command line.
Every field is a ``--section.field`` flag (cli/args.py); the docstring under a field is its help
text."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from onegpu.config.data import DataConfig
from onegpu.config.grpo import GRPOConfig
from onegpu.errors import ConfigError

# FP8 training's settings (techniques.fp8): off, auto (the planner decides), or torchao.float8's
# recipe. One type, so a recipe cannot be asked for with FP8 switched off.
Fp8Recipe = Literal["off", "auto", "tensorwise", "rowwise", "rowwise-gw-hp"]


@dataclass
class ModelConfig:
    name: str = "auto"
    """Preset (tiny, small, 125m, 1b, 3b), Hub model id or local model directory. auto: tiny on CPU,
    125m on a GPU."""
    tokenizer: Optional[str] = None
    """Tokenizer id or directory. Default: the model's own; presets: a byte-level BPE trained on the
    data, cached."""
    vocab_size: int = 4096
    """Vocabulary size of the locally trained tokenizer (presets only)."""
    split_digits: bool = False
    """Give every digit its own token in the locally trained tokenizer (presets only), so numbers
    are spelt digit by digit rather than merged into rare multi-digit tokens. The calculator job's
    warm-up sets it."""
    from_scratch: bool = False
    """Initialise a Hub/local model's architecture with random weights instead of loading them."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code from the model repository to run. Off unless you trust it."""


@dataclass
class TrainingConfig:
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto", "reward", "grpo"] = "sft"
    """What the run optimises. sft: next-token cross-entropy. dpo / orpo / simpo: preference tuning
    on prompt + chosen + rejected pairs (the preference section); the default data then becomes
    pairs made from the standard library (the real continuation of a snippet chosen over a
    word-shuffled one). kto: unpaired preference tuning on prompt + completion + label (true:
    desirable) records, or on pairs split into a desirable and an undesirable example (the default
    data's too). reward: a reward model (a one-output sequence-classification head on the model)
    trained Bradley-Terry on the same pairs; the saved model loads with
    AutoModelForSequenceClassification. grpo: online RL on prompts, scored by reward functions
    (the grpo section); with no model and no data it trains the default job's model to continue
    standard-library code into Python that compiles."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (effective batch = micro_batch_size x
    grad_accum)."""
    max_steps: int = 200
    """Optimizer steps to run."""
    max_minutes: float = 0.0
    """Stop after this many minutes of training (0 = no limit); the run still evaluates and saves.
    """
    lr: Union[float, Literal["auto"]] = "auto"
    """Peak learning rate. auto: by mode and objective (hyper.py). sft: 2e-3 from scratch, 2e-5
    full fine-tune, 2e-4 LoRA/QLoRA; dpo/orpo/simpo: 5e-4 from scratch, 1e-6 full fine-tune, 5e-6
    LoRA/QLoRA; reward: 5e-4 from scratch, else TRL RewardConfig's 1e-4."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine decay)."""
    warmup_steps: Union[int, Literal["auto"]] = "auto"
    """Linear warm-up steps. auto (unless warmup_ratio is set): sft: 20 from scratch, else 3% of
    max_steps; dpo/orpo/simpo: 10% of max_steps."""
    warmup_ratio: Optional[float] = None
    """Warm-up as a share of max_steps, in [0, 1), instead of warmup_steps (set one of the two)."""
    weight_decay: Union[float, Literal["auto"]] = "auto"
    """Decoupled weight decay, never on biases and norm weights. auto: 0.1 for sft from scratch,
    else 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    eval_every: int = 50
    """Evaluate every N optimizer steps (0 = only at the end)."""
    eval_batches: int = 10
    """Validation batches per evaluation (0 = the whole validation set)."""
    save_every: int = 0
    """Write a checkpoint every N optimizer steps (0 = only the final model)."""
    log_every: int = 10
    """Write metrics every N optimizer steps."""
    seed: int = 1234
    """Seed for model init, data order and dropout."""
    max_bad_steps: int = 5
    """Stop after this many steps in a row with a NaN/inf loss or gradient (each skipped; 0 = never
    stop)."""
    oom_retry: bool = True
    """On out-of-memory, halve the micro-batch, double grad_accum (same effective batch) and retry
    the step."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters instead of the full model (PEFT)."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    targets: str = "all-linear"
    """Modules to adapt: "all-linear" or comma-separated names (e.g. "q_proj,v_proj")."""
    dora: bool = False
    """Weight-decomposed LoRA (DoRA)."""
    quantize_base: Literal["none", "nf4", "fp4", "int8"] = "none"
    """Quantize the frozen base with bitsandbytes (nf4 = QLoRA)."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Adapter weights (and so their gradients and optimizer state). auto = bf16 with
    precision=bf16-pure (the whole model is bf16, as in torchtune's recipes), else fp32 (PEFT's
    default: adapters are the master weights of mixed precision). bf16 halves adapter memory."""
    merge_on_save: bool = False
    """Also save a merged full model next to the adapter."""


@dataclass
class TechniquesConfig:
    precision: Literal["auto", "fp32", "fp16", "bf16", "bf16-pure"] = "auto"
    """Compute precision. auto = bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU.
    bf16-pure also stores the weights in bf16."""
    tf32: Optional[bool] = None
    """TF32 matmuls on Ampere+ GPUs (default: on where supported)."""
    checkpointing: Literal["off", "full", "every-n", "offload"] = "off"
    """Gradient checkpointing: recompute activations in backward instead of storing them."""
    checkpointing_every: int = 2
    """With checkpointing=every-n: checkpoint every n-th decoder layer."""
    attention: Literal["auto", "eager", "sdpa", "flash"] = "auto"
    """Attention kernel. auto = the fastest the model and device support: flash_attention_2
    (flash_attn, GPU, fp16/bf16), else sdpa (PyTorch SDPA), else eager; flash = SDPA's flash kernel
    or flash_attn's."""
    padding_free: bool = False
    """Pack variable-length examples into one row with position_ids instead of padding."""
    shared_prompt: Literal["auto", "on", "off"] = "auto"
    """Reward models: a pair's chosen and rejected responses in one row after one copy of their
    prompt (a mask keeps each response from seeing the other) instead of two rows that each repeat
    it: the same scores and gradients from fewer tokens. auto: on where the model can take it (an
    eager forward, attention sdpa or eager, no MoE router loss, no sliding window, one process);
    on: an error where it cannot; off: two padded rows per pair, as TRL."""
    optimizer: Literal[
        "adamw",
        "adamw-foreach",
        "adamw-fused",
        "adafactor",
        "adamw-8bit",
        "paged-adamw-8bit",
        "adamw-8bit-ao",
        "adamw-4bit-ao",
        "sgd",
    ] = "adamw"
    """Optimizer. adamw picks the fastest available torch implementation."""
    optimizer_in_backward: bool = False
    """Update each parameter inside backward, as soon as its gradient is complete, and free that
    gradient at once: the full set of gradients never exists (saves one copy of the trainable
    weights). Needs training.grad_accum=1 and training.max_grad_norm=0; not with fp16 or offload."""
    compile: Literal["auto", "off", "default", "max-autotune", "reduce-overhead"] = "auto"
    """torch.compile mode. auto = default where it pays: a run of 50+ steps, a compiler for the
    device (g++ on CPU, triton on GPU), no quantized base or DeepSpeed offload; else off."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    compile_regional: bool = True
    """Compile each decoder block separately (fast compile, same speed) instead of the whole model.
    """
    loss: Literal["auto", "fused", "plain"] = "auto"
    """Cross-entropy. fused: the output head and the loss run loss_chunk_size tokens at a time with
    their gradients taken in the forward, so the full (tokens x vocab) logits never exist (faster,
    far less memory). plain: the model's full logits, then the loss. auto: fused wherever the model
    allows it (the head weights not sharded, its logits reproducible), plain otherwise."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused loss (0 = from the vocabulary size and the device)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning."""
    vision: Literal["frozen", "projector", "all"] = "frozen"
    """A vision-language model's image side: frozen (the vision tower and projector keep their
    weights), projector (the projector trains), all (tower and projector train; with LoRA, adapters
    go on the tower too)."""
    offload: Literal["none", "zero2-cpu", "zero3-cpu", "zero3-nvme"] = "none"
    """DeepSpeed ZeRO with optimizer/parameter offload, for models that do not fit."""
    nvme_path: str = "/tmp/onegpu-nvme"
    """Folder for offload=zero3-nvme."""
    activation_offload: bool = False
    """Move every tensor autograd saves for backward (above activation_offload_min_bytes) to host
    memory during the forward and bring it back just before the backward needs it; on CUDA the
    copies run on a side stream, overlapped with compute, into pinned buffers. With checkpointing
    on, the saved tensors are the block inputs. Trades PCIe traffic for GPU memory."""
    activation_offload_min_bytes: int = 1 << 20
    """Saved tensors smaller than this stay on the device: their copies would cost more in launch
    and synchronisation than the memory they free."""
    tiled_mlp: Literal["auto", "on", "off"] = "auto"
    """Run each decoder layer's MLP over tiles of the sequence, recomputing the tile's intermediate
    in backward, so the (tokens x intermediate) activations never exist whole. auto: on when the
    training sequence is at least tiled_mlp_min_seq tokens; MoE blocks are left as they are."""
    tiled_mlp_min_seq: int = 8192
    """With tiled_mlp=auto: the sequence length (tokens per row) from which the MLP is tiled."""
    tiled_mlp_tile_tokens: int = 0
    """Tokens per MLP tile (0 = the model's hidden size: a tile's intermediate is then about the
    size of one MLP weight matrix)."""
    fp8: Fp8Recipe = "auto"
    """FP8 training (torchao.float8): the Linear layers' matmuls run in float8 with dynamic scales
    on the FP8 tensor cores of Ada, Hopper and newer GPUs; weights, gradients and checkpoints stay
    in their own dtype. tensorwise: one scale per tensor (fastest); rowwise: one per row (more
    accurate); rowwise-gw-hp: rowwise, the weight gradient in high precision (most accurate). The
    output head and Linears with a dimension not a multiple of 16 stay in high precision. auto: the
    planner (onegpu plan, train --plan auto) turns it on where it predicts a gain and chooses the
    layers; a run without the planner trains without it."""
    fp8_skip: str = ""
    """Linear layers kept in high precision besides the rule's (comma-separated names, e.g.
    "k_proj,v_proj"); the planner writes here the layers whose float8 matmuls would be slower."""
    fp8_emulate: bool = False
    """Cast and scale to float8 exactly as on a card but multiply in high precision (torchao's
    emulate): FP8's numerics on a CPU or a GPU without FP8 tensor cores, to check them; no gain."""


@dataclass
class PreferenceConfig:
    beta: Union[float, Literal["auto"]] = "auto"
    """Strength of the preference term. auto: DPO 0.1 (Rafailov et al. 2023; TRL's default), ORPO's
    lambda 0.1 (Hong et al. 2024), SimPO 2.0 (Meng et al. 2024, the range 2.0-2.5 of its recipes),
    KTO 0.1 (TRL's KTOConfig default).
    """
    reference: Literal["auto", "adapters", "precomputed", "copy"] = "auto"
    """DPO's and KTO's reference model. adapters: the LoRA base with the adapters switched off (no
    copy); precomputed: its log-probs computed in one pass before training (kept in the run
    directory); copy: a frozen copy in memory. auto: adapters with LoRA, else precomputed.
    ORPO/SimPO use none.
    """
    label_smoothing: float = 0.0
    """Share of pairs assumed mislabelled (conservative DPO, Mitchell 2023), in [0, 0.5)."""
    simpo_gamma_ratio: float = 0.5
    """SimPO's target margin as a share of beta (gamma = ratio x beta; the paper's recipes use
    0.3-0.6)."""
    desirable_weight: float = 1.0
    """KTO: weight of a desirable example's loss (TRL's default 1.0; with fewer desirable than
    undesirable examples, the KTO paper's eq. 8 advises raising it toward their ratio)."""
    undesirable_weight: float = 1.0
    """KTO: weight of an undesirable example's loss (TRL's default 1.0)."""
    center_rewards_coefficient: Optional[float] = None
    """Reward models: weight of (r_chosen + r_rejected)^2, keeping rewards centred on 0 (Eisenstein
    et al. 2023; TRL's RewardConfig: off by default, 0.01 advised)."""


@dataclass
class OutputConfig:
    dir: str = "runs"
    """Parent folder of run directories."""
    name: Optional[str] = None
    """Run directory name (default: a timestamp)."""
    overwrite: bool = False
    """Allow writing into a non-empty run directory."""
    resume: Optional[str] = None
    """Resume from "latest" (in the run directory) or a checkpoint path."""
    keep_last: int = 2
    """Checkpoints to keep (the best by eval loss is kept too)."""
    report_to: str = "tensorboard"
    """Experiment trackers that receive the metrics of metrics.jsonl (same names and steps) and the
    config: tensorboard (run_dir/tensorboard), wandb, mlflow, trackio, a comma-separated list of
    them, all (the installed ones) or none. Project: $WANDB_PROJECT / $MLFLOW_EXPERIMENT_NAME, else
    $ONEGPU_PROJECT, else onegpu; run name: the run directory's."""
    tensorboard: Optional[bool] = None
    """Deprecated, use report_to (kept so config.yaml files of older runs still load and resume):
    false removes tensorboard from report_to, true adds it. Folded into report_to when the config is
    read."""

    def __post_init__(self):
        self.report_to = _tracker_list(self.report_to)
        if self.tensorboard is None:
            return
        # the old switch, folded in once: config.yaml then records only report_to
        warnings.warn(
            "output.tensorboard is deprecated: use output.report_to (e.g. --output.report_to none "
            "for tensorboard=false); this config's value is folded into report_to.",
            FutureWarning,
            stacklevel=3,
        )
        if self.report_to == "all" and not self.tensorboard:
            raise ConfigError(
                "output.tensorboard=false cannot take TensorBoard out of output.report_to=all.",
                hint="name the trackers, e.g. --output.report_to wandb,mlflow",
            )
        if self.report_to != "all":
            names = [n for n in self.report_to.split(",") if n not in ("none", "tensorboard")]
            self.report_to = (
                ",".join((["tensorboard"] if self.tensorboard else []) + names) or "none"
            )
        self.tensorboard = None


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


def _tracker_list(value: str) -> str:
    """output.report_to in one spelling (lower case, no spaces or repeats), or a ConfigError naming
    the bad part."""
    if not isinstance(value, str):
        raise ConfigError(
            f"output.report_to must be a string, got {value!r}.",
            hint="e.g. --output.report_to wandb",
        )
    names = list(dict.fromkeys(n.strip().lower() for n in value.split(",") if n.strip())) or [
        "none"
    ]
    for name in names:
        if name not in (*TRACKERS, "all", "none"):
            raise ConfigError(
                f"output.report_to: unknown tracker '{name}'.",
                hint=f"choose from {', '.join(TRACKERS)}, a comma-separated list of them, all or "
                "none",
            )
    if len(names) > 1 and ({"all", "none"} & set(names)):
        raise ConfigError(
            f"output.report_to={value!r}: 'all' and 'none' stand alone.",
            hint="write all, none, or a list of trackers such as tensorboard,wandb",
        )
    return ",".join(names)


@dataclass
class DistributedConfig:
    strategy: Literal["auto", "ddp", "fsdp2", "deepspeed"] = "auto"
    """How processes share the work when launched with torchrun/accelerate launch. auto: DeepSpeed
    when techniques.offload is set, otherwise DDP (a single process needs none of them)."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (1-3) for strategy=deepspeed without offload; each offload mode implies
    its own stage (zero2-cpu: 2, zero3-*: 3)."""
    fsdp_sharding: Literal["full", "hybrid"] = "full"
    """FSDP2: full = shard weights, gradients and optimizer state over all processes; hybrid = shard
    within a node and replicate across nodes (less inter-node traffic)."""
    keep_global_batch: bool = True
    """Keep the single-process effective batch when the process count changes: each of N processes
    accumulates training.grad_accum / N micro-batches (must divide). false: training.grad_accum is
    per process and the global batch grows with N."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train (a preset, a local folder or a Hub id) and its tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """What to train on: the records, their format, the sequence length, the loading workers."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation: objective, batch, steps, learning-rate schedule, evaluation and checkpoint
    cadence."""
    techniques: TechniquesConfig = field(default_factory=TechniquesConfig)
    """How each step runs: precision, attention, checkpointing, optimizer, compile, loss, LoRA,
    offload."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where the run directory goes, what it keeps, and where metrics are reported."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """Preference tuning (training.objective dpo / orpo / simpo / kto / reward)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Online RL from verifiable rewards (training.objective grpo): sampling, rewards, the loss."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Several processes/GPUs (DDP, FSDP2, DeepSpeed); ignored in a single plain process."""
    plan: Literal["off", "auto"] = "off"
    """auto: predict candidate setups, probe the best few here, train with the fastest that fits
    (same batch)."""
