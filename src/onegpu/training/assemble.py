"""THE assembly of a run: model, objective, optimizer and accelerator, built in one order by one
function (``assemble``). Training, the planner's probes, its accuracy check and its activation
measurement all call it, each with what it changes; a run is then made of the parts it returns
(``Run``), so no half-built run exists."""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onegpu import models
from onegpu.config import Config
from onegpu.errors import ConfigError
from onegpu.hardware import DeviceInfo
from onegpu.objectives import Objective, make_objective
from onegpu.training.data import Data, check_seq_len, longest_sequence
from onegpu.training.startup import check_model_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """A run, built: its settled config, where it runs and writes, its data, its prepared parts."""

    cfg: Config
    device: DeviceInfo
    dir: Path
    model_name: str
    precision: str
    data: Data
    model: Any  # prepared (techniques/prepare.py) and placed by the accelerator
    optimizer: Any
    scheduler: Any  # torch LambdaLR over the optimizer (lr_schedule)
    objective: Objective

    # the data's parts, read often enough by the loop, evaluation and checkpoints to name directly
    @property
    def tokenizer(self):
        return self.data.tokenizer

    @property
    def train_ds(self):
        return self.data.train_ds

    @property
    def val_ds(self):
        return self.data.val_ds

    @property
    def collator(self):
        return self.data.collator

    @property
    def data_format(self) -> str:
        return self.data.format


@dataclass(frozen=True)
class Prepared:
    """What ``assemble`` returns: the prepared model and what trains it."""

    model: Any
    objective: Objective
    optimizer: Any = None  # None when no optimizer was asked for (the activation measurement)
    scheduler: Any = None


def assemble(
    cfg: Config,
    device: DeviceInfo,
    precision: str,
    source,
    *,
    tokenizer=None,
    accelerator=None,
    optimizer: bool = True,
    probe: bool = False,
) -> Prepared:
    """Build a model and what trains it, in this order (and why):

    1. the model from ``source``: a model name (``models.load_model``, with the load-time
       arguments of techniques/prepare.load_kwargs), a transformers config (built at random, with
       the dtype and attention kernel load_kwargs would choose) or an already built model (the
       planner's uninitialised measuring copy);
    2. with a tokenizer: start-up checks on the loaded model (positions, shape advice) and the
       embeddings sized to the tokenizer;
    3. preference objectives and GRPO: dropout off; a copy reference taken now, before adapters
       or compile;
    4. THE pipeline (techniques/prepare.prepare_model), FSDP2 sharding last with an accelerator;
    5. the optimizer and its schedule, over the final parameters (``optimizer=False``: none);
    6. the accelerator's prepare (device placement, DDP / DeepSpeed engines), before any reference
       pass, so the reference runs on the device and under the run's autocast;
    7. the objective, with its reference (``probe``: fixed reference log-probs for a planner probe
       of a precomputed-reference setup).
    """
    import functools

    from onegpu import distributed
    from onegpu.objectives import preference, reference
    from onegpu.techniques.prepare import prepare_model, resolved_techniques

    model = _load(cfg, device, precision, source, tokenizer)
    if tokenizer is not None:
        check_seq_len(cfg, getattr(model.config, "max_position_embeddings", None))
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        # the dtype the weights are stored in: a load (fp32 for fp16 autocast) rewrites
        # model.config's
        stored = model.config
        if isinstance(source, str) and not models.is_preset(source):
            stored = models.model_config(source, cfg.model.trust_remote_code)
        check_model_settings(cfg, device, precision, model, stored)
    vocab = getattr(model.config, "vocab_size", 0) or 0
    objective = cfg.training.objective
    copied = None
    if objective != "sft":
        preference.disable_dropout(model)
        if reference.kind_of(cfg) == "copy":
            copied = copy.deepcopy(model)  # the starting weights, before adapters or compile
    shard = (
        functools.partial(
            distributed.apply_fsdp2, cfg=cfg, precision=precision, accelerator=accelerator
        )
        if accelerator is not None
        else None
    )
    tcfg = resolved_techniques(cfg, device.type)
    model = prepare_model(model, tcfg, device.type, shard, longest_sequence(cfg))
    opt, scheduler = build_optimizer(cfg, device, model) if optimizer else (None, None)
    autocast = None
    if accelerator is not None:
        model, opt = distributed.prepare(accelerator, model, opt)
        autocast = accelerator.autocast
        if copied is not None:
            copied.to(accelerator.device)
    compiled = tcfg.compile != "off"
    loss = make_objective(cfg, vocab, device.is_gpu, copied, autocast, probe, tokenizer, compiled)
    loss.check_model(model)
    if loss.needs_reference is not None:
        log.info("%s reference: %s", objective.upper(), loss.needs_reference)
    return Prepared(model, loss, opt, scheduler)


def _load(cfg: Config, device: DeviceInfo, precision: str, source, tokenizer):
    import torch

    score = cfg.training.objective == "reward"  # a reward model: a score head, no LM head
    if isinstance(source, str):
        from onegpu.techniques.prepare import load_kwargs

        model = models.load_model(
            source,
            cfg.model,
            tokenizer,
            **load_kwargs(cfg, device, precision, source),
            score_head=score,
        )
    elif isinstance(source, torch.nn.Module):
        return source
    else:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        from onegpu.techniques.prepare import build_kwargs

        if score:
            source = copy.copy(source)
            source.num_labels = 1
        model = (AutoModelForSequenceClassification if score else AutoModelForCausalLM).from_config(
            source,
            trust_remote_code=cfg.model.trust_remote_code,
            **build_kwargs(cfg, device, precision, source),
        )
    if score and tokenizer is not None:
        # the head scores each row's last token before padding, found by pad_token_id (as TRL sets)
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def make_accelerator(cfg: Config, device: DeviceInfo, precision: str):
    """The Accelerate object that owns devices, autocast, loss scaling and (later) distribution.

    Accumulation is done by our loop (token-normalised), so Accelerate's own is left at 1.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from onegpu import distributed
    from onegpu.techniques.precision import (
        accelerate_mixed_precision,
        enable_loss_scaling,
    )

    # Accelerate keeps one precision/plugin setting per process, and refuses a second Accelerator
    # with other settings; one process may run several jobs (benchmark arms, planner probes, a
    # notebook), so each starts clean. Accelerate has no public way to do this: its private reset is
    # called here and nowhere else. The process group (PartialState) stays.
    AcceleratorState._reset_state(reset_partial_state=False)
    # Several processes or offload: the DeepSpeed / FSDP2 plugin (and its precision) from our
    # config.
    engine = distributed.accelerator_kwargs(cfg, precision, device.type == "cuda")
    # Accelerate's cpu=True would switch DeepSpeed off; DS_ACCELERATOR=cpu already keeps it on the
    # CPU.
    cpu = device.type == "cpu" and "deepspeed_plugin" not in engine
    kwargs = {"mixed_precision": accelerate_mixed_precision(precision), "cpu": cpu, **engine}
    accelerator = Accelerator(**kwargs)
    distributed.fix_cpu_deepspeed_state(accelerator)
    if "deepspeed_plugin" not in engine:  # DeepSpeed scales fp16 losses itself
        enable_loss_scaling(
            accelerator, precision
        )  # fp16 on CPU: Accelerate creates no scaler there
    return accelerator


def build_optimizer(cfg: Config, device: DeviceInfo, model):
    """(optimizer, its learning-rate schedule) over the prepared model's parameters."""
    import torch

    from onegpu import distributed
    from onegpu.techniques import offload
    from onegpu.techniques.optimizers import build_optimizer as make

    t = cfg.training  # settled (plain numbers) where the run or the probe began: see hyper.py
    if cfg.techniques.optimizer_in_backward:
        if distributed.world_size() > 1:
            raise ConfigError(
                "techniques.optimizer_in_backward runs in one process only: several processes "
                "reduce gradients after the update would already have used them.",
                hint="launch one process, or turn techniques.optimizer_in_backward off",
            )
        if t.oom_retry:
            log.info(
                "optimizer_in_backward: out-of-memory retry is off (a step that runs out of memory "
                "in backward has already updated part of the weights)"
            )
    if offload.use_cpu_adam(cfg, device.is_gpu):  # offloaded state: DeepSpeed's vectorised CPU Adam
        from onegpu.techniques.optimizers import BETAS, param_groups

        optimizer = offload.cpu_adam(param_groups(model, t.weight_decay), t.lr, BETAS)
    else:
        optimizer = make(model, cfg.techniques, t)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_schedule(t))


def lr_schedule(t):
    """Linear warm-up, then cosine decay to min_lr_ratio x peak at max_steps (``t`` settled: warm-up
    in steps)."""

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.max_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def configure_threads() -> None:
    """Tokenizer threads fight DataLoader workers and datasets' processes; keep them quiet."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
