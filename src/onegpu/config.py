"""Typed run configuration: one dataclass per concern, loaded from YAML and/or the command line.
Every field is a ``--section.field`` flag (cli/args.py); the docstring under a field is its help text."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from onegpu.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "auto"
    """Preset (tiny, small, 125m, 1b), Hub model id or local model directory. auto: tiny on CPU, 125m on a GPU."""
    tokenizer: Optional[str] = None
    """Tokenizer id or directory. Default: the model's own; presets: a byte-level BPE trained on the data, cached."""
    vocab_size: int = 4096
    """Vocabulary size of the locally trained tokenizer (presets only)."""
    from_scratch: bool = False
    """Initialise a Hub/local model's architecture with random weights instead of loading them."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code from the model repository to run. Off unless you trust it."""


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Local file or folder (jsonl/json/csv/parquet/txt) or a Hub dataset name. Default: the
    Python standard library's own source files."""
    format: Literal["auto", "text", "prompt_completion", "messages"] = "auto"
    """Record shape. "auto" detects it from the columns (text / prompt+completion / messages)."""
    text_field: str = "text"
    """Column holding raw text."""
    prompt_field: str = "prompt"
    """Column holding the prompt (prompt_completion format)."""
    completion_field: str = "completion"
    """Column holding the completion (prompt_completion format)."""
    messages_field: str = "messages"
    """Column holding chat messages (messages format)."""
    seq_len: int = 256
    """Tokens per training sequence (packed block length, or truncation length)."""
    overlong: Literal["truncate", "drop", "split"] = "split"
    """Chat/prompt-completion records over seq_len (counted in the log and summary). split: a chat is cut on turn
    boundaries (system message kept, an assistant turn too long alone left out); prompt/completion, with no turn to
    cut on, is dropped. drop: left out. truncate: cut at seq_len, a cut assistant turn not trained on (its EOS is
    gone), a prompt cut from its start. Default split: never trains on a cut turn, keeps every turn that fits."""
    val_fraction: float = 0.05
    """Share of files (or records) held out for validation."""
    max_bytes: int = 6_000_000
    """Read at most this many bytes of the default standard-library corpus (0 = all)."""
    num_proc: int = 2
    """Processes used to tokenize."""
    pin_memory: bool = True
    """Page-lock host batches so copies to the GPU run asynchronously (GPU only)."""
    num_workers: int = 0
    """DataLoader worker processes preparing batches in the background."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (num_workers > 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs and evals (num_workers > 0)."""
    pad_to_multiple: int = 64
    """Pad variable-length batches to a multiple of this (tensor cores; torch.compile recompiles less)."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 16
    """Sequences per forward/backward pass."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (effective batch = micro_batch_size x grad_accum)."""
    max_steps: int = 200
    """Optimizer steps to run."""
    max_minutes: float = 0.0
    """Stop after this many minutes of training (0 = no limit); the run still evaluates and saves."""
    lr: Union[float, Literal["auto"]] = "auto"
    """Peak learning rate. auto: by mode (hyper.py): 2e-3 from scratch, 2e-5 full fine-tune, 2e-4 LoRA/QLoRA."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine decay)."""
    warmup_steps: Union[int, Literal["auto"]] = "auto"
    """Linear warm-up steps. auto: 20 from scratch, else 3% of max_steps (unless warmup_ratio is set)."""
    warmup_ratio: Optional[float] = None
    """Warm-up as a share of max_steps, in [0, 1), instead of warmup_steps (set one of the two)."""
    weight_decay: Union[float, Literal["auto"]] = "auto"
    """Decoupled weight decay, never on biases and norm weights. auto: 0.1 from scratch, else 0."""
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
    """Stop after this many steps in a row with a NaN/inf loss or gradient (each skipped; 0 = never stop)."""
    oom_retry: bool = True
    """On out-of-memory, halve the micro-batch, double grad_accum (same effective batch) and retry the step."""


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
    """Attention kernel. auto = the fastest the model and device support: flash_attention_2 (flash_attn,
    GPU, fp16/bf16), else sdpa (PyTorch SDPA), else eager; flash = SDPA's flash kernel or flash_attn's."""
    padding_free: bool = False
    """Pack variable-length examples into one row with position_ids instead of padding."""
    optimizer: Literal["adamw", "adamw-foreach", "adamw-fused", "adafactor", "adamw-8bit",
                       "paged-adamw-8bit", "adamw-8bit-ao", "adamw-4bit-ao", "sgd"] = "adamw"
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
    """Compile each decoder block separately (fast compile, same speed) instead of the whole model."""
    loss: Literal["auto", "fused", "plain"] = "auto"
    """Cross-entropy. fused: the output head and the loss run loss_chunk_size tokens at a time with
    their gradients taken in the forward, so the full (tokens x vocab) logits never exist (faster,
    far less memory). plain: the model's full logits, then the loss. auto: fused wherever the model
    allows it (the head weights not sharded, its logits reproducible), plain otherwise."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the fused loss (0 = from the vocabulary size and the device)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning."""
    offload: Literal["none", "zero2-cpu", "zero3-cpu", "zero3-nvme"] = "none"
    """DeepSpeed ZeRO with optimizer/parameter offload, for models that do not fit."""
    nvme_path: str = "/tmp/onegpu-nvme"
    """Folder for offload=zero3-nvme."""


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
    tensorboard: bool = True
    """Write TensorBoard event files."""


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
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    techniques: TechniquesConfig = field(default_factory=TechniquesConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Several processes/GPUs (DDP, FSDP2, DeepSpeed); ignored in a single plain process."""
    plan: Literal["off", "auto"] = "off"
    """auto: predict candidate setups, probe the best few here, train with the fastest that fits (same batch)."""


POSITIVE_INTS = {
    "data.seq_len", "data.num_proc", "data.prefetch_factor", "data.pad_to_multiple", "model.vocab_size",
    "training.micro_batch_size", "training.grad_accum", "training.max_steps", "training.log_every",
    "techniques.checkpointing_every", "techniques.lora.r", "output.keep_last",
}
NON_NEGATIVE = {
    "data.max_bytes", "data.num_workers", "training.max_minutes", "training.lr", "training.warmup_steps",
    "training.weight_decay", "training.max_grad_norm", "training.eval_every", "training.eval_batches",
    "training.save_every", "techniques.loss_chunk_size", "techniques.lora.dropout", "training.max_bad_steps",
}
# Optimizers DeepSpeed offload can replace with its own CPU Adam; the others keep state it cannot move.
OFFLOAD_OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused")


def validate(cfg: Config) -> Config:
    """Check values the types cannot express; raise one ConfigError naming the field and the fix."""
    flat = to_dict(cfg)
    for key in sorted(POSITIVE_INTS):
        if _get(flat, key) <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {_get(flat, key)}.", hint=f"set {key} >= 1")
    for key in sorted(NON_NEGATIVE):  # "auto" is settled to a number by hyper.py, and checked then
        if _get(flat, key) != "auto" and _get(flat, key) < 0:
            raise ConfigError(f"{key} must not be negative, got {_get(flat, key)}.", hint=f"set {key} >= 0")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}.",
                          hint="set data.val_fraction to e.g. 0.05 (0 = no validation)")
    if not 0.0 <= cfg.training.min_lr_ratio <= 1.0:
        raise ConfigError(f"training.min_lr_ratio must be in [0, 1], got {cfg.training.min_lr_ratio}.",
                          hint="set training.min_lr_ratio to e.g. 0.1")
    if cfg.distributed.zero_stage not in (1, 2, 3):
        raise ConfigError(f"distributed.zero_stage must be 1, 2 or 3, got {cfg.distributed.zero_stage}.",
                          hint="set distributed.zero_stage to 1, 2 or 3")
    _check_conflicts(cfg)
    return cfg


def _check_conflicts(cfg: Config) -> None:
    """Combinations that each make sense alone but not together."""
    tech, out = cfg.techniques, cfg.output
    if tech.offload != "none" and tech.optimizer not in OFFLOAD_OPTIMIZERS:
        raise ConfigError(f"techniques.offload={tech.offload} cannot be combined with techniques.optimizer="
                          f"{tech.optimizer}: DeepSpeed offload runs its own CPU AdamW.",
                          hint="set techniques.optimizer=adamw, or techniques.offload=none")
    if tech.lora.quantize_base != "none" and not tech.lora.enabled:
        raise ConfigError(f"techniques.lora.quantize_base={tech.lora.quantize_base} needs LoRA: a quantized base "
                          "cannot be trained directly.", hint="add --techniques.lora.enabled true")
    if tech.loss == "plain" and tech.loss_chunk_size:
        raise ConfigError(f"techniques.loss_chunk_size={tech.loss_chunk_size} sets the fused loss's chunks, but "
                          "techniques.loss=plain.", hint="drop techniques.loss_chunk_size, or set techniques.loss=fused")
    if tech.optimizer_in_backward:
        _check_optimizer_in_backward(cfg)
    if out.resume and out.overwrite:
        raise ConfigError("output.resume and output.overwrite contradict each other (continue the run vs "
                          "start it again).", hint="drop one of --output.resume / --output.overwrite")


def _check_optimizer_in_backward(cfg: Config) -> None:
    """What an update inside backward cannot do (see techniques/optimizer_in_backward.py)."""
    tech, t = cfg.techniques, cfg.training
    reasons = [
        (t.grad_accum > 1, f"training.grad_accum={t.grad_accum}: each micro-batch's gradient would be applied "
                           "before the next one is added", "set training.grad_accum=1 (a larger micro-batch instead)"),
        (t.max_grad_norm > 0, f"training.max_grad_norm={t.max_grad_norm}: the global norm is only known once every "
                              "gradient exists", "set training.max_grad_norm=0"),
        (tech.precision == "fp16", "techniques.precision=fp16: loss scaling must check all gradients before any "
                                   "update", "use bf16 (or fp32)"),
        (tech.offload != "none", f"techniques.offload={tech.offload}: DeepSpeed runs its own optimizer",
         "set techniques.offload=none"),
    ]
    for bad, why, fix in reasons:
        if bad:
            raise ConfigError(f"techniques.optimizer_in_backward cannot be combined with {why}.", hint=fix)


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d[part]
    return d


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a dataclass from a nested dict, rejecting unknown keys with a did-you-mean."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}.")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{where}'.", hint=hint)
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(value or {}, tp, where + ".")
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(map(str, args))}"
            raise ConfigError(f"{where}: invalid value '{value}'.", hint=hint)
        return value
    if origin is Union and type(None) not in args:  # a number or "auto": the first member that takes it
        for member in args:
            try:
                return _coerce(value, member, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} must be a number or 'auto', got {value!r}.", hint=f"set {where} to e.g. auto")
    if args and type(None) in args:  # Optional[X]
        if value is None:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}.", hint=f"set {where} to true or false")
        return value
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and value != int(value)):
            raise ConfigError(f"{where} must be {'an integer' if tp is int else 'a number'}, got {value!r}.",
                              hint=f"write {where} as a plain number, without quotes")
        return tp(value)
    if tp is str and not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}.")
    return value


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", hint="check the path given to --config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)}).",
                          hint="check the indentation and brackets at that line") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, training, ...).",
                          hint="start the file with a section, e.g. 'training:' then indented keys")
    return data


def save_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False), encoding="utf-8")


SECRET_PATTERN = re.compile(r"(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,})")


def redact(data: Any) -> Any:
    """A copy of a config dict with access tokens blanked, so saved configs and logs never leak them:
    values that look like tokens, and the values of any *TOKEN*/*SECRET*/*KEY* environment variable."""
    import os

    secrets = [v for k, v in os.environ.items() if len(v) >= 8 and re.search(r"TOKEN|SECRET|PASSWORD|API_?KEY", k)]

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, str):
            for s in secrets:
                v = v.replace(s, "<redacted>")
            return SECRET_PATTERN.sub("<redacted>", v)
        return v

    return clean(data)
