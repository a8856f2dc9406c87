"""One benchmark arm in a fresh process: ``python -m onegpu.bench.train_child spec.json result.json``.

Both kinds of arm — our `train()` and HF `Trainer` — import their libraries, reset the peak
memory counter, then tokenize (from the cache), build the model from the same seed and train on the
same examples in the same order. Timing leaves out the first `warmup_steps` steps and is read at
the logging boundaries only, where both loops synchronise anyway.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from pathlib import Path

from onegpu.training.state import Callback


class MemoryProbe:
    """Peak memory from here on: max_memory_allocated on CUDA; on CPU the process's peak resident
    set (VmHWM), reset through /proc/self/clear_refs so imports made before do not count twice."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # not Linux, or not allowed: the peak then includes start-up
            pass
        self.base = _status_kb("VmRSS") * 1024

    def read(self) -> dict:
        import torch

        peak = torch.cuda.max_memory_allocated() if self.cuda else _status_kb("VmHWM") * 1024
        return {"peak_mem_mb": peak / 2**20, "train_mem_mb": (peak - self.base) / 2**20,
                "memory_kind": "cuda max_memory_allocated" if self.cuda else "peak RSS (VmHWM)"}


def _status_kb(key: str) -> int:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1))


def preimport(kind: str) -> None:
    """Load the libraries before the memory reset, so the peak counts training, not imports.
    Only the HF arm loads `transformers.Trainer` (seconds of start-up the other arms skip)."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (train() plots the loss at the end)
    import torch  # noqa: F401

    import onegpu.training.run  # noqa: F401

    for mod in model_modules():
        importlib.import_module(mod)
    if kind == "hf":
        from transformers import Trainer, TrainingArguments  # noqa: F401


def model_modules() -> list[str]:
    """Modules that building the model loads on first use (the method modules, the Llama code and
    torch.compile's machinery that some of them touch): ~100 MB of code, not training memory."""
    import pkgutil

    import onegpu.techniques

    mods = [f"onegpu.techniques.{m.name}" for m in pkgutil.iter_modules(onegpu.techniques.__path__)]
    return mods + ["transformers.models.llama.modeling_llama", "torch._dynamo"]


# ------------------------------------------------------------------------------------------ onegpu
def run_onegpu(spec: dict, probe: MemoryProbe | None = None, callbacks: tuple = ()) -> dict:
    """Our `train()`, unchanged; its metrics.jsonl windows give the timing. A callback keeps a
    handle on the run (to report which methods really took effect) and reads memory when the loop
    returns: saving the model and plotting afterwards are not training."""
    import onegpu
    from onegpu.config import from_dict
    from onegpu.report import read_metrics

    watch = Watch(probe)
    result = onegpu.train(from_dict(spec["config"]), callbacks=[watch, *callbacks])
    records = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r.get("split") == "train"]
    out = timing_from_windows(records, spec["warmup_steps"])
    out["evidence"] = evidence(watch.run)
    out["tokens_seen"] = result.state.tokens_seen
    out["steps_done"] = result.state.step
    out.update(watch.memory)
    return out


class Watch(Callback):
    """Observes the loop: the prepared run (for the evidence) and memory when training ends."""

    def __init__(self, probe: MemoryProbe | None):
        self.probe, self.run, self.memory = probe, None, {}

    def on_train_begin(self, run, state) -> None:
        self.run = run

    def on_train_end(self, run, state) -> None:
        self.memory = self.probe.read() if self.probe is not None else {}


def timing_from_windows(records: list[dict], warmup: int) -> dict:
    """Each log record covers the steps since the previous one; drop those up to `warmup`."""
    steps = tokens = 0
    seconds = 0.0
    prev_step, prev_tokens = 0, 0
    for r in records:
        window_tokens = r["tokens_seen"] - prev_tokens
        if prev_step >= warmup:
            steps += r["step"] - prev_step
            tokens += window_tokens
            seconds += window_tokens / max(r["tokens_per_s"], 1e-9)
        prev_step, prev_tokens = r["step"], r["tokens_seen"]
    final = records[-1]["loss"] if records else None
    return {"timed_steps": steps, "timed_tokens": tokens, "timed_seconds": seconds, "final_loss": final}


def evidence(run) -> dict:
    """Facts read off the live objects, so a method that did not take effect shows as such."""
    if run is None:
        return {}
    import torch

    from onegpu.models import count_parameters

    model = getattr(run.model, "module", run.model)
    total, trainable = count_parameters(model)
    opt = getattr(run.optimizer, "optimizer", run.optimizer)
    state_dtypes = sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)})
    return {"optimizer": f"{type(opt).__module__}.{type(opt).__name__}", "trainable_params": trainable,
            "total_params": total, "param_dtype": str(next(model.parameters()).dtype),
            "optimizer_state_dtypes": state_dtypes, "precision": run.precision,
            "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "compiled": any(getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")
                            for m in model.modules()),
            "peft": type(model).__module__.startswith("peft"),
            "attention": getattr(getattr(model, "config", None), "_attn_implementation", None)}


# ------------------------------------------------------------------------------------------ HF
def run_hf(spec: dict, callbacks: tuple = ()) -> dict:
    """transformers.Trainer on our tokenized examples, in the order our loop would draw them."""
    from accelerate.utils import set_seed
    from transformers import Trainer, TrainingArguments

    from onegpu import hardware, models
    from onegpu.training import assemble
    from onegpu.data import batches
    from onegpu.config import from_dict

    cfg = from_dict(spec["config"])
    t = cfg.training
    device = hardware.detect()
    set_seed(t.seed)
    run = assemble.Run(cfg, device, Path(cfg.output.dir), models.resolve_name(cfg.model, device.is_gpu), "fp32")
    assemble.build_data(run)
    set_seed(t.seed)
    model = models.load_model(run.model_name, cfg.model, run.tokenizer, attn_implementation="sdpa")
    order = iter(batches.BatchOrder(len(run.train_ds), t.micro_batch_size, t.seed))
    step_batches = [[i for _ in range(t.grad_accum) for i in next(order)] for _ in range(t.max_steps)]
    dataset = run.train_ds.select([i for step in step_batches for i in step])
    lengths = [len(x) for x in dataset["input_ids"]]
    per_step = [sum(lengths[s * len(b): (s + 1) * len(b)]) for s, b in enumerate(step_batches)]
    timer = make_timer(spec["warmup_steps"], spec["budget_s"], t.log_every, device.type == "cuda")
    args = TrainingArguments(**hf_arguments(cfg, spec["arm"], device))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=run.collator,
                      callbacks=[timer, *callbacks])
    trainer.train()
    out = timer.result(per_step)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out.update(final_loss=losses[-1] if losses else None, steps_done=trainer.state.global_step,
               tokens_seen=sum(per_step[: trainer.state.global_step]),
               evidence={"optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
                         "fused": bool(opt.defaults.get("fused")), "precision": "bf16" if args.bf16 else
                         ("fp16" if args.fp16 else "fp32"), "workers": args.dataloader_num_workers,
                         "compiled": bool(args.torch_compile)})
    return out


def hf_arguments(cfg, arm: str, device) -> dict:
    """Trainer defaults, with only the run's hyper-parameters set to ours (same schedule, same
    numbers); the tuned arm adds the guide's speed flags that this device supports."""
    t = cfg.training
    args = dict(output_dir=str(Path(cfg.output.dir) / "hf"), per_device_train_batch_size=t.micro_batch_size,
                gradient_accumulation_steps=t.grad_accum, max_steps=t.max_steps, learning_rate=t.lr,
                weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
                lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
                adam_beta2=0.95, max_grad_norm=t.max_grad_norm, seed=t.seed, logging_steps=t.log_every,
                save_strategy="no", report_to="none", disable_tqdm=True, train_sampling_strategy="sequential")
    if arm == "hf-trainer-tuned":
        from onegpu.techniques.compile import has_cpu_compiler

        args.update(optim="adamw_torch_fused", dataloader_num_workers=2, dataloader_pin_memory=True)
        if device.type == "cuda":
            args.update(bf16=device.bf16, fp16=not device.bf16, tf32=device.tf32 or None, torch_compile=True)
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
            if time.perf_counter() - self.t0 > budget_s:
                control.should_training_stop = True

        def result(self, per_step: list[int]) -> dict:
            start = next(((s, t) for s, t in self.marks if s >= warmup), None)
            if start is None or self.marks[-1][0] <= start[0]:
                return {"timed_steps": 0, "timed_tokens": 0, "timed_seconds": 0.0}
            end = self.marks[-1]
            return {"timed_steps": end[0] - start[0], "timed_tokens": sum(per_step[start[0]: end[0]]),
                    "timed_seconds": end[1] - start[1]}

    return StepTimer()


def main(argv: list[str]) -> int:
    import logging
    import os

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(argv[0]).read_text())
    preimport(spec["kind"])
    from onegpu import hardware
    peak = hardware.measure_matmul_flops(hardware.detect().type, seconds=0.5)  # under the load this arm trains in
    probe = MemoryProbe()
    t0 = time.perf_counter()
    result = run_onegpu(spec, probe) if spec["kind"] == "onegpu" else run_hf(spec)
    if "peak_mem_mb" not in result:
        result.update(probe.read())
    result.update(peak_flops=peak, status="ok", wall_s=time.perf_counter() - t0, arm=spec["arm"], rep=spec["rep"])
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
