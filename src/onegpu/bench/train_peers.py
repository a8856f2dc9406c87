"""The peer trainers of `onegpu bench train`, each in the arm's own process (see train_child.py):
HF ``Trainer`` (at its defaults, and with the guide's flags) and TRL's ``SFTTrainer`` (at its
defaults, which since TRL 1.7 include a chunked cross-entropy that never builds the full logits).

Both get what our loop would train on: the same tokenized examples, in the order our loop draws
them, and the run's hyper-parameters (learning rate and schedule, batch, accumulation, steps, seed,
clipping). Everything else is the peer's own default, recorded as evidence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class PeerSetup:
    """What both peers start from: the run settings, the device, the tokenizer and collator, the
    model built from the run's seed, and the examples in our loop's order."""

    cfg: Any  # onegpu.config.Config
    device: Any  # onegpu.hardware.DeviceInfo
    model_name: str
    # onegpu.training.data.Records: the records before tokenizing (TRL tokenizes them itself)
    records: Any
    data: Any  # onegpu.training.data.Data: tokenizer, tokenized splits, collator
    model: Any
    dataset: Any  # datasets.Dataset: one row per micro-batch example, step by step
    per_step: list[int]  # real (non-padding) tokens of each optimizer step
    indices: list[int]  # the row of data.train_ds behind each row of dataset


def load(spec: dict) -> tuple:
    """(run settings, device, model name, records, tokenized data, the peer's model): what every
    peer arm, GRPO's too, builds first."""
    from accelerate.utils import set_seed

    from onegpu import hardware, models
    from onegpu.config import from_dict
    from onegpu.training.data import build_data, read_records

    cfg = from_dict(spec["config"])
    device = hardware.detect()
    set_seed(cfg.training.seed)
    name = models.resolve_name(cfg.model, device.is_gpu)
    recs = read_records(cfg)
    data = build_data(cfg, name, recs)
    return cfg, device, name, recs, data, peer_model(cfg, device, name, data.tokenizer)


def setup(spec: dict) -> PeerSetup:
    from onegpu.data import batches

    cfg, device, name, recs, data, model = load(spec)
    t = cfg.training
    order = iter(batches.BatchOrder(len(data.train_ds), t.micro_batch_size, t.seed))
    step_batches = [
        [i for _ in range(t.grad_accum) for i in next(order)] for _ in range(t.max_steps)
    ]
    indices = [i for step in step_batches for i in step]
    dataset = data.train_ds.select(indices)
    lengths = example_tokens(dataset)
    per_step = [sum(lengths[s * len(b) : (s + 1) * len(b)]) for s, b in enumerate(step_batches)]
    return PeerSetup(cfg, device, name, recs, data, model, dataset, per_step, indices)


def peer_model(cfg, device, name: str, tokenizer):
    """The peers' model as HF builds it (their own techniques, not our pipeline), at our seed and
    attention kernel; for a reward model with the one-output score head TRL's RewardTrainer loads
    (AutoModelForSequenceClassification, num_labels 1), as ours."""
    from accelerate.utils import set_seed

    from onegpu import models

    set_seed(cfg.training.seed)
    return models.load_model(
        name,
        cfg.model,
        tokenizer,
        attn_implementation=_attention(cfg, device, name),
        score_head=cfg.training.objective == "reward",
    )


def example_tokens(dataset) -> list[int]:
    """Real tokens of each example as the loops feed them: one sequence, a KTO example's prompt +
    completion (its mismatched sequence, a no-grad forward for the KL estimate, is not counted: the
    loop counts the trained sequences), or for a preference pair prompt + chosen and prompt +
    rejected (the two sequences of its forward)."""
    if "input_ids" in dataset.column_names:
        return [len(x) for x in dataset["input_ids"]]
    if "completion_ids" in dataset.column_names:
        return [
            len(p) + len(c)
            for p, c in zip(dataset["prompt_ids"], dataset["completion_ids"], strict=True)
        ]
    return [
        2 * len(p) + len(c) + len(r)
        for p, c, r in zip(
            dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True
        )
    ]


def _attention(cfg, device, model_name: str) -> str:
    """The kernel our arms resolve for this model and device, so the peers run the same
    attention."""
    from onegpu import models
    from onegpu.techniques.attention import model_kernels, resolve_attention
    from onegpu.techniques.precision import resolve_precision

    trust = cfg.model.trust_remote_code
    kernels = model_kernels(models.model_config(model_name, trust), trust)
    return resolve_attention(
        cfg.techniques, device, resolve_precision(cfg.techniques, device), kernels
    )


def timer(spec: dict, p: PeerSetup):
    """The peer's clock (make_timer) for this arm's warm-up, budget and logging."""
    cuda = p.device.type == "cuda"
    return make_timer(spec["warmup_steps"], spec["budget_s"], p.cfg.training.log_every, cuda)


def run_hf(spec: dict, callbacks: tuple = ()) -> dict:
    """transformers.Trainer on our tokenized examples, in the order our loop would draw them."""
    from transformers import Trainer, TrainingArguments

    p = setup(spec)
    clock = timer(spec, p)
    args = TrainingArguments(**hf_arguments(p.cfg, spec["arm"], p.device))
    trainer = Trainer(
        model=p.model,
        args=args,
        train_dataset=p.dataset,
        data_collator=p.data.collator,
        callbacks=[clock, *callbacks],
    )
    trainer.train()
    return _result(trainer, args, clock, p.per_step)


def run_trl(spec: dict, callbacks: tuple = ()) -> dict:
    """TRL's SFTTrainer at its defaults on the same examples in the same order.

    The dataset is handed over tokenized (input_ids and labels: the labels carry our masks, e.g.
    assistant-only on chat data) with ``skip_prepare_dataset``, so TRL neither re-tokenizes,
    truncates to its default max_length (1024), nor drops rows; its own collator pads them.
    Its other defaults stay: bf16 autocast, gradient checkpointing, its loss (a fused, chunked
    LM head since TRL 1.7), the Trainer optimizer."""
    import trl
    from trl import SFTConfig, SFTTrainer

    p = setup(spec)
    clock = timer(spec, p)
    kw = hf_arguments(p.cfg, "trl-sft", p.device)
    if p.device.type == "cpu":
        kw["use_cpu"] = True  # TRL's default bf16 refuses to start on a CPU without it
    args = SFTConfig(**kw, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(
        model=p.model,
        args=args,
        train_dataset=p.dataset,
        processing_class=p.data.tokenizer,
        callbacks=[clock, *callbacks],
    )
    trainer.train()
    out = _result(trainer, args, clock, p.per_step)
    base = (
        trainer.model.get_base_model()
        if hasattr(trainer.model, "get_base_model")
        else trainer.model
    )
    out["evidence"].update(
        trl=trl.__version__,
        loss_type=args.loss_type,
        # SFTTrainer patches the model's forward with its fused, chunked LM head + loss (no full
        # logits)
        chunked_loss=args.loss_type == "chunked_nll" or "forward" in vars(base),
        # what the logged loss is divided by: Trainer's count of target tokens over the whole
        # accumulated batch when the model accepts it, as our loop does; else a per-micro-batch mean
        loss_normalisation="summed over the target tokens of the accumulated batch"
        if getattr(trainer, "model_accepts_loss_kwargs", False)
        else "mean per micro-batch",
        checkpointing=bool(args.gradient_checkpointing),
        collator=type(trainer.data_collator).__name__,
    )
    return out


def _result(trainer, args, timer, per_step: list[int]) -> dict:
    out = timer.result(per_step)
    out.update(
        final_loss=final_loss(trainer),
        steps_done=trainer.state.global_step,
        tokens_seen=sum(per_step[: trainer.state.global_step]),
        evidence=trainer_evidence(trainer, args),
    )
    return out


def final_loss(trainer) -> float | None:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses[-1] if losses else None


def trainer_evidence(trainer, args) -> dict:
    """What a peer trainer really ran with, read off its objects and arguments."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    params = list(trainer.model.parameters())
    return {
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
        "fused": bool(opt.defaults.get("fused")),
        "precision": "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32"),
        "workers": args.dataloader_num_workers,
        "compiled": bool(args.torch_compile),
        "checkpointing": bool(args.gradient_checkpointing),
        "trainable_params": sum(x.numel() for x in params if x.requires_grad),
        "total_params": sum(x.numel() for x in params),
    }


def precision_arguments(cfg, device) -> dict:
    """The same arithmetic on TRL's side: its default is bf16 autocast, ours fp32 on a CPU and the
    preset's bf16 on a GPU (every TRL peer: DPO, KTO, reward models, GRPO)."""
    from onegpu.techniques.precision import resolve_precision

    precision = resolve_precision(cfg.techniques, device)
    kw = {"bf16": precision.startswith("bf16"), "fp16": precision == "fp16"}
    if device.type == "cpu":
        kw["use_cpu"] = True
    return kw


def hf_arguments(cfg, arm: str, device) -> dict:
    """Trainer defaults, with only the run's hyper-parameters set to ours (same schedule, same
    numbers); the tuned arm adds the guide's speed flags that this device supports. TRL's arm
    takes the same keys, on top of SFTConfig's own defaults."""
    t = cfg.training  # settled by base_config: plain numbers
    args = dict(
        output_dir=str(Path(cfg.output.dir) / "hf"),
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        max_steps=t.max_steps,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
        adam_beta2=0.95,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        logging_steps=t.log_every,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    if arm == "hf-trainer-tuned":
        from onegpu.techniques.compile import has_cpu_compiler

        args.update(optim="adamw_torch_fused", dataloader_num_workers=2, dataloader_pin_memory=True)
        if device.type == "cuda":
            args.update(
                bf16=device.bf16, fp16=not device.bf16, tf32=device.tf32 or None, torch_compile=True
            )
        elif has_cpu_compiler():
            args.update(torch_compile=True)
    return args


def make_timer(warmup: int, budget_s: float, every: int, cuda: bool):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Clock reads at the logging boundaries (synchronised on CUDA), and the time budget."""

        def __init__(self):
            self.marks: list[tuple[int, float]] = []
            self.t0 = time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                if cuda:
                    import torch

                    torch.cuda.synchronize()
                self.marks.append((state.global_step, time.perf_counter()))
                # Trainer logs only every logging_steps; our loop also logs the last step, so the
                # final loss is the same window's (steps since the previous log) on both sides.
                control.should_log = True
            if time.perf_counter() - self.t0 > budget_s:
                control.should_training_stop = True

        def result(self, per_step: list[int]) -> dict:
            start = next(((s, t) for s, t in self.marks if s >= warmup), None)
            if start is None or self.marks[-1][0] <= start[0]:
                return {"timed_steps": 0, "timed_tokens": 0, "timed_seconds": 0.0}
            from onegpu.bench.timing import startup_seconds

            end = self.marks[-1]
            steps, seconds = end[0] - start[0], end[1] - start[1]
            return {
                "timed_steps": steps,
                "timed_tokens": sum(per_step[start[0] : end[0]]),
                "timed_seconds": seconds,
                "startup_s": startup_seconds(start[1] - self.t0, start[0], seconds, steps),
            }

    return StepTimer()
