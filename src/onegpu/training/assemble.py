"""Everything a run needs before its first step: run directory, tokenizer, data, model, optimizer."""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onegpu import models, report
from onegpu.data import batches
from onegpu.data import records
from onegpu.data.overlong import DataStats
from onegpu.config import Config, save_yaml
from onegpu.errors import ConfigError, DataError
from onegpu.hardware import DeviceInfo

log = logging.getLogger(__name__)


@dataclass
class Run:
    cfg: Config
    device: DeviceInfo
    dir: Path
    model_name: str
    precision: str
    tokenizer: Any = None
    train_ds: Any = None
    val_ds: Any = None
    collator: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    loss_fn: Any = None  # (model, batch) -> summed token loss; see techniques/loss.py
    data_format: str = ""  # text | prompt-completion | chat: detected from the columns
    data_stats: list[DataStats] = field(default_factory=list)  # per split: records cut, dropped, split
    sample_prompt: str | None = None  # a prompt from the data, for the end-of-run generate hint
    train_records: Any = None  # the training records before tokenizing (a peer benchmark tokenizes them itself)
    reference_model: Any = None  # preference.reference=copy: the frozen starting model
    reference_seconds: float | None = None  # preference.reference=precomputed: the pass before training
    val_rewards: dict = field(default_factory=dict)  # preference objectives: the last evaluation's rewards


def check_run_dir(cfg: Config) -> Path:
    """Where the run will write, checked without writing anything (a bad input must leave no trace)."""
    out = cfg.output
    name = out.name or time.strftime("%Y%m%d-%H%M%S")
    path = Path(out.dir).expanduser() / name
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run directory {path} is a file.", hint="choose another --output.name or --output.dir")
    if path.exists() and any(path.iterdir()) and not (out.overwrite or out.resume):
        raise ConfigError(f"run directory {path} is not empty.",
                          hint="pass --output.resume latest to continue it, --output.overwrite true, or another --output.name")
    parent = _existing_ancestor(path)
    problem = _unwritable(parent)
    if problem:
        raise ConfigError(f"cannot write to run directory {path}: {parent} is not a writable folder ({problem}).",
                          hint="choose a writable --output.dir")
    return path


def _unwritable(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None. os.access is not the answer: root passes it
    on a read-only folder, and some mounts (read-only network or FUSE filesystems) grant it and
    then refuse the write. So a file is created and removed at once: nothing is left behind."""
    import errno
    import tempfile

    if not folder.is_dir():
        return "it is a file"
    try:
        fd, probe = tempfile.mkstemp(prefix=".onegpu-write-test-", dir=folder)
    except OSError as exc:
        return "read-only file system" if exc.errno == errno.EROFS else (exc.strerror or str(exc)).lower()
    os.close(fd)
    os.unlink(probe)
    return None


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def create_run_dir(path: Path, is_main: bool = True) -> None:
    if not is_main:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to run directory {path}: {exc.strerror}.",
                          hint="choose a writable --output.dir") from None


CHECKPOINT_MARGIN = 64 * 2**20  # bytes: config, tokenizer, metrics and filesystem slack


def checkpoint_bytes(model) -> int:
    """A checkpoint's size, estimated generously: weights plus optimizer moments ~ 3x the parameters."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + CHECKPOINT_MARGIN


def check_disk(run: Run) -> None:
    """Fail before training, not at the first save hours later, when a checkpoint cannot fit."""
    import shutil

    need = checkpoint_bytes(run.model)
    folder = _existing_ancestor(run.dir)
    free = shutil.disk_usage(folder).free
    if free < need:
        # A read-only filesystem reports no free space: say what is really wrong.
        problem = _unwritable(folder)
        if problem:
            raise ConfigError(f"cannot write to run directory {run.dir}: {folder} is not a writable folder "
                              f"({problem}).", hint="choose a writable --output.dir")
        raise ConfigError(f"not enough free disk for checkpoints in {run.dir}: {free / 2**30:.2f} GiB free, "
                          f"about {need / 2**30:.2f} GiB needed per checkpoint.",
                          hint="free space, or choose another --output.dir")


def build_tokenizer(cfg: Config, model_name: str, train_records, fmt: str, fingerprint: str):
    """Presets get a byte-level BPE trained on the training split; everything else its own tokenizer."""
    mcfg = cfg.model
    if mcfg.tokenizer:
        return models.load_tokenizer(mcfg.tokenizer, mcfg.trust_remote_code)
    if not models.is_preset(model_name):
        return models.load_tokenizer(model_name, mcfg.trust_remote_code)
    from onegpu.data.tokenizer import train_tokenizer

    texts = records.corpus_texts(train_records, fmt, cfg.data)
    return train_tokenizer(texts, mcfg.vocab_size, fingerprint)


def build_data(run: Run) -> None:
    cfg = run.cfg
    train_rec, val_rec, fingerprint = records.load_records(cfg.data, cfg.training.seed)
    if cfg.training.objective != "sft" and cfg.data.path is None:
        train_rec, val_rec = corpus_pairs(cfg, train_rec, val_rec)
    fmt = records.detect_format(cfg.data, train_rec.column_names)
    check_objective(cfg, fmt, train_rec.column_names)
    t0 = time.perf_counter()
    run.tokenizer = build_tokenizer(cfg, run.model_name, train_rec, fmt, fingerprint)
    check_positions(cfg, run.model_name)  # before tokenizing: a too long seq_len is not "no examples"
    run.train_ds, stats = batches.tokenize_counted(train_rec, fmt, run.tokenizer, cfg.data, fingerprint, "train")
    run.data_stats = [stats]
    run.val_ds = None
    if val_rec is not None:
        run.val_ds, stats = batches.tokenize_counted(val_rec, fmt, run.tokenizer, cfg.data, fingerprint, "validation")
        run.data_stats.append(stats)
    for stats in run.data_stats:
        log.info("data %s", stats.describe())
    if len(run.train_ds) == 0:
        train = run.data_stats[0]
        if train.overlong:  # the policy left nothing: say so, with the counts
            raise DataError(f"no training examples after tokenization: {train.describe()}.",
                            hint="raise data.seq_len (up to the model's limit), or choose another data.overlong")
        raise DataError("no training examples after tokenization (all records too short or fully masked).",
                        hint="lower data.seq_len or check the data")
    run.collator = batches.Collator(run.tokenizer.pad_token_id, cfg.data.pad_to_multiple, cfg.data.seq_len,
                                    position_ids=cfg.techniques.padding_free)
    if fmt == "preference":  # each pair: its chosen and rejected sequences in the one batch
        from onegpu.data.pairs import PairCollator

        run.collator = PairCollator(run.collator)
    run.data_format, run.train_records = fmt, train_rec
    run.sample_prompt = report.sample_prompt(val_rec if val_rec is not None else train_rec, fmt, cfg.data)
    log.info("data: %s, %d train / %d val examples of <= %d tokens (%.1fs)", fmt, len(run.train_ds),
             len(run.val_ds or []), cfg.data.seq_len, time.perf_counter() - t0)


def corpus_pairs(cfg: Config, train_rec, val_rec):
    """The default job's preference pairs, made from the standard library's sources (data/pairs.py), as
    many as the run will use: DPO's reference pass then costs no more."""
    from onegpu.data.pairs import corpus_pairs as make

    t = cfg.training
    train = make(train_rec, cfg.data.text_field, t.seed, t.max_steps * t.micro_batch_size * t.grad_accum)
    val = make(val_rec, cfg.data.text_field, t.seed, max(t.eval_batches, 1) * t.micro_batch_size) \
        if val_rec is not None else None
    return train, val


def check_objective(cfg: Config, fmt: str, columns: list[str]) -> None:
    """Preference pairs go with a preference objective, and only with one."""
    d, objective = cfg.data, cfg.training.objective
    if objective == "sft" and fmt == "preference":
        raise DataError(f"{d.path}: preference pairs (columns '{d.chosen_field}' and '{d.rejected_field}'), but "
                        "training.objective=sft.", hint="set --training.objective dpo (or orpo / simpo) to train on pairs")
    if objective != "sft" and fmt != "preference":
        raise DataError(f"training.objective={objective} needs preference pairs: columns '{d.prompt_field}', "
                        f"'{d.chosen_field}' and '{d.rejected_field}'; {d.path} has {columns}.",
                        hint="rename the columns (or set data.chosen_field / data.rejected_field), or train with "
                        "training.objective=sft")


def check_positions(cfg: Config, model_name: str) -> None:
    """data.seq_len against the model's max_position_embeddings, read from its config alone (no
    weights). A config that cannot be read here is left to the model load, which explains why."""
    try:
        config = models.model_config(model_name, cfg.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - any failure here is reported by build_model with its fix
        return
    _check_seq_len(cfg, getattr(config, "max_position_embeddings", None))


def _check_seq_len(cfg: Config, limit) -> None:
    if isinstance(limit, int) and cfg.data.seq_len > limit:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={limit}.",
                          hint=f"set data.seq_len <= {limit}")


def build_model(run: Run, accelerator=None) -> None:
    """Load the model and prepare it through the one pipeline (techniques/prepare.py). With an
    accelerator, a multi-process FSDP2 run also shards it; the optimizer is built after."""
    import functools

    from onegpu import distributed
    from onegpu.techniques.prepare import load_kwargs, prepare_model, resolved_techniques

    cfg = run.cfg
    model = models.load_model(run.model_name, cfg.model, run.tokenizer,
                              **load_kwargs(cfg, run.device, run.precision, run.model_name))
    _check_seq_len(cfg, getattr(model.config, "max_position_embeddings", None))
    if len(run.tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(run.tokenizer))
    check_model_settings(run, model)
    if cfg.training.objective != "sft":
        from onegpu.techniques import preference, reference

        preference.disable_dropout(model)
        if reference.choose(cfg.training.objective, cfg.preference.reference, cfg.techniques.lora.enabled) == "copy":
            run.reference_model = copy.deepcopy(model)  # the starting weights, before adapters or compile
    shard = (functools.partial(distributed.apply_fsdp2, cfg=cfg, precision=run.precision, accelerator=accelerator)
             if accelerator is not None else None)
    run.model = prepare_model(model, resolved_techniques(cfg, run.device.type), run.device.type, shard)
    run.loss_fn = make_loss_fn(cfg, getattr(model.config, "vocab_size", 0) or 0, run.device.is_gpu)


def check_model_settings(run: Run, model) -> None:
    """Start-up advice that depends on the loaded model and the device."""
    from onegpu.techniques.batchsize import check_shapes
    from onegpu.techniques.precision import warn_fp16_on_bf16_model

    cfg = run.cfg
    # the dtype the weights are stored in: a load (fp32 for fp16 autocast) rewrites model.config's
    stored = model.config if models.is_preset(run.model_name) else models.model_config(
        run.model_name, cfg.model.trust_remote_code)
    warn_fp16_on_bf16_model(stored, run.precision)
    check_shapes(cfg.training.micro_batch_size, cfg.data.seq_len, getattr(model.config, "hidden_size", None),
                 run.precision, run.device)


def make_loss_fn(cfg: Config, vocab: int, on_gpu: bool):
    from onegpu import distributed
    from onegpu.techniques.loss import LossFn

    sft = LossFn.for_run(cfg.techniques, vocab, on_gpu, distributed.shards_weights(cfg))
    if cfg.training.objective == "sft":
        return sft
    from onegpu.techniques.preference import PreferenceLoss

    return PreferenceLoss(cfg.training.objective, cfg.preference, sft.chunk_size, fallback=sft.fallback)


def prepare_reference(run: Run, accelerator, resumed: bool = False, probe: bool = False) -> None:
    """DPO's reference, once the model is on its device (techniques/reference.py): adapters off, a copy,
    or log-probs precomputed into the data (a planner probe, timing steps only, takes fixed ones).
    Nothing for SFT, ORPO and SimPO."""
    from onegpu.techniques import reference

    cfg = run.cfg
    kind = reference.choose(cfg.training.objective, cfg.preference.reference, cfg.techniques.lora.enabled)
    if kind == "adapters":
        run.loss_fn.reference = reference.AdapterReference(run.loss_fn.chunk_size)
    elif kind == "copy":
        run.reference_model.to(accelerator.device)
        run.loss_fn.reference = reference.CopyReference(run.reference_model, accelerator.autocast,
                                                        run.loss_fn.chunk_size)
    elif kind == "precomputed" and probe:
        run.loss_fn.reference = reference.FixedReference()
    elif kind == "precomputed":
        reference.precompute(run, accelerator, resumed)
    if kind:
        log.info("DPO reference: %s", kind)


def make_accelerator(cfg: Config, device: DeviceInfo, precision: str):
    """The Accelerate object that owns devices, autocast, loss scaling and (later) distribution.

    Accumulation is done by our loop (token-normalised), so Accelerate's own is left at 1.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from onegpu import distributed
    from onegpu.techniques.precision import accelerate_mixed_precision, enable_loss_scaling

    # Accelerate keeps one precision/plugin setting per process; one process may run several jobs
    # (benchmark arms, planner probes, a notebook), so each starts clean. The process group stays.
    AcceleratorState._reset_state(reset_partial_state=False)
    # Several processes or offload: the DeepSpeed / FSDP2 plugin (and its precision) from our config.
    engine = distributed.accelerator_kwargs(cfg, precision, device.type == "cuda")
    # Accelerate's cpu=True would switch DeepSpeed off; DS_ACCELERATOR=cpu already keeps it on the CPU.
    cpu = device.type == "cpu" and "deepspeed_plugin" not in engine
    kwargs = {"mixed_precision": accelerate_mixed_precision(precision), "cpu": cpu, **engine}
    accelerator = Accelerator(**kwargs)
    distributed.fix_cpu_deepspeed_state(accelerator)
    if "deepspeed_plugin" not in engine:  # DeepSpeed scales fp16 losses itself
        enable_loss_scaling(accelerator, precision)  # fp16 on CPU: Accelerate creates no scaler there
    return accelerator


def build_optimizer(run: Run) -> None:
    import torch

    from onegpu import distributed
    from onegpu.techniques import offload
    from onegpu.techniques.optimizers import build_optimizer as make

    t = run.cfg.training  # settled (plain numbers) where the run or the probe began: see hyper.py
    if run.cfg.techniques.optimizer_in_backward:
        if distributed.world_size() > 1:
            raise ConfigError("techniques.optimizer_in_backward runs in one process only: several processes reduce "
                              "gradients after the update would already have used them.",
                              hint="launch one process, or turn techniques.optimizer_in_backward off")
        if t.oom_retry:
            log.info("optimizer_in_backward: out-of-memory retry is off (a step that runs out of memory in "
                     "backward has already updated part of the weights)")
    if offload.use_cpu_adam(run.cfg, run.device.is_gpu):  # offloaded state: DeepSpeed's vectorised CPU Adam
        from onegpu.techniques.optimizers import BETAS, param_groups

        run.optimizer = offload.cpu_adam(param_groups(run.model, t.weight_decay), t.lr, BETAS)
    else:
        run.optimizer = make(run.model, run.cfg.techniques, t)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lr_lambda=lr_schedule(t))


def lr_schedule(t):
    """Linear warm-up, then cosine decay to min_lr_ratio x peak at max_steps (``t`` settled: warm-up in steps)."""

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.max_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def save_config(run: Run) -> None:
    # the detected data format is recorded, as the settled hyper-parameters are: `onegpu generate`
    # reads it to feed a model trained on chat data its prompts as chat turns
    cfg = copy.deepcopy(run.cfg)
    cfg.data.format = run.data_format or cfg.data.format
    save_yaml(cfg, run.dir / "config.yaml")


def configure_threads() -> None:
    """Tokenizer threads fight DataLoader workers and datasets' processes; keep them quiet."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
