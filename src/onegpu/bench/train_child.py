"""One benchmark arm in a fresh process: ``python -m onegpu.bench.train_child spec.json
result.json``.

Every kind of arm — our `train()`, HF `Trainer`, TRL's `SFTTrainer` (train_peers.py), its
`GRPOTrainer` (train_grpo.py), its `DPOTrainer`, `KTOTrainer` and `RewardTrainer` (train_trl.py) —
imports its libraries, resets the peak memory counter, then tokenizes (from the cache), builds the
model from the same seed and trains on the same examples in the same order. Timing leaves out the
first `warmup_steps` steps and is read at the logging boundaries only, where the loops synchronise
anyway.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from pathlib import Path

from onegpu.bench.timing import startup_seconds
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
        return {
            "peak_mem_mb": peak / 2**20,
            "train_mem_mb": (peak - self.base) / 2**20,
            "memory_kind": "cuda max_memory_allocated" if self.cuda else "peak RSS (VmHWM)",
        }


def _status_kb(key: str) -> int:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1))


# Each TRL arm kind's trainer, as trl names it (<name>Trainer, <name>Config).
TRL = {"trl": "SFT", "trl-dpo": "DPO", "trl-grpo": "GRPO", "trl-kto": "KTO", "trl-reward": "Reward"}


def preimport(kind: str) -> None:
    """Load the libraries before the memory reset, so the peak counts training, not imports.
    Only the peer arms load `transformers.Trainer` / `trl` (seconds of start-up ours skip)."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (train() plots the loss at the end)
    import torch  # noqa: F401

    import onegpu.training.run  # noqa: F401

    for mod in model_modules():
        importlib.import_module(mod)
    if kind != "onegpu":
        from transformers import Trainer, TrainingArguments  # noqa: F401
    if kind in TRL:  # trl loads its trainers lazily: the arm's own one and its config now
        import trl

        getattr(trl, f"{TRL[kind]}Trainer"), getattr(trl, f"{TRL[kind]}Config")
    if kind == "trl-reward":
        from transformers.models.llama import LlamaForSequenceClassification  # noqa: F401


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
    records = train_windows(read_metrics(result.run_dir / "metrics.jsonl"))
    out = timing_from_windows(records, spec["warmup_steps"])
    out["evidence"] = evidence(watch.run)
    if watch.reference_pass:  # a precomputed reference: its pass ran before the timed steps
        out["reference_pass"] = watch.reference_pass
    if records and "reward_accuracy" in records[-1]:  # preference objectives log them
        out.update(
            reward_accuracy=records[-1]["reward_accuracy"],
            reward_margin=records[-1].get("reward_margin"),
        )
    if records and "gen_tokens_per_s" in records[-1]:  # GRPO: per step, generation apart
        from onegpu.bench.train_grpo import onegpu_steps, step_timing

        t = spec["config"]["training"]
        out["steps"] = onegpu_steps(records, t["micro_batch_size"] * t["grad_accum"])
        out.update(step_timing(out["steps"], spec["warmup_steps"]))
    out["tokens_seen"] = result.state.tokens_seen
    out["steps_done"] = result.state.step
    out["skipped_steps"] = result.state.skipped_steps
    out.update(watch.memory)
    return out


class Watch(Callback):
    """Observes the loop: the prepared run (for the evidence), DPO's reference pass (timed again,
    warm, in the untimed first window), and memory when training ends."""

    def __init__(self, probe: MemoryProbe | None):
        self.probe, self.run, self.memory, self.reference_pass = probe, None, {}, {}
        self.reference_seconds: float | None = None

    def on_reference_pass(self, seconds: float) -> None:
        self.reference_seconds = seconds

    def on_train_begin(self, run, state) -> None:
        from onegpu.bench.train_trl import reference_pass

        self.run = run
        self.reference_pass = reference_pass(run, self.reference_seconds)

    def on_train_end(self, run, state) -> None:
        self.memory = self.probe.read() if self.probe is not None else {}


def train_windows(records: list[dict]) -> list[dict]:
    """The training log's timing windows. A step the loop skipped (non-finite loss or gradients)
    writes a record with only ``skipped``: no tokens, no clock, no loss. Its tokens and time stay
    in the open window, which the next full record closes, so that record covers both steps."""
    return [r for r in records if r.get("split") == "train" and "skipped" not in r]


def timing_from_windows(records: list[dict], warmup: int) -> dict:
    """Each log record covers the steps since the previous one; drop those up to `warmup`. Their
    time beyond the steady rate is the start-up cost (compiling, the allocator's first growth)."""
    steps = tokens = early_steps = 0
    seconds = early_seconds = 0.0
    prev_step, prev_tokens = 0, 0
    for r in records:
        window_tokens = r["tokens_seen"] - prev_tokens
        window_seconds = window_tokens / max(r["tokens_per_s"], 1e-9)
        if prev_step >= warmup:
            steps += r["step"] - prev_step
            tokens += window_tokens
            seconds += window_seconds
        else:
            early_steps += r["step"] - prev_step
            early_seconds += window_seconds
        prev_step, prev_tokens = r["step"], r["tokens_seen"]
    final = records[-1]["loss"] if records else None
    return {
        "timed_steps": steps,
        "timed_tokens": tokens,
        "timed_seconds": seconds,
        "startup_s": startup_seconds(early_seconds, early_steps, seconds, steps),
        "final_loss": final,
    }


def evidence(run) -> dict:
    """Facts read off the live objects, so a method that did not take effect shows as such."""
    if run is None:
        return {}
    import torch

    from onegpu.models import count_parameters

    model = getattr(run.model, "module", run.model)
    total, trainable = count_parameters(model)
    opt = getattr(run.optimizer, "optimizer", run.optimizer)
    state_dtypes = sorted(
        {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    )
    return {
        "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
        "trainable_params": trainable,
        "total_params": total,
        "param_dtype": str(next(model.parameters()).dtype),
        "optimizer_state_dtypes": state_dtypes,
        "precision": run.precision,
        "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "compiled": any(
            getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")
            for m in model.modules()
        ),
        "peft": type(model).__module__.startswith("peft"),
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "reference": _reference_kind(run),
    }


def _reference_kind(run) -> str | None:
    """DPO's reference as this run really computed it (None for SFT and the reference-free
    objectives)."""
    return run.objective.reference_name


def main(argv: list[str]) -> int:
    import logging
    import os

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(argv[0]).read_text())
    preimport(spec["kind"])
    from onegpu import hardware

    # under the load this arm trains in
    peak = hardware.measure_matmul_flops(hardware.detect().type, seconds=0.5)
    probe = MemoryProbe()
    t0 = time.perf_counter()
    if spec["kind"] == "onegpu":
        result = run_onegpu(spec, probe)
    else:
        from onegpu.bench import train_grpo, train_peers, train_trl

        runners = {
            "hf": train_peers.run_hf,
            "trl": train_peers.run_trl,
            "trl-dpo": train_trl.run_trl_preference,
            "trl-grpo": train_grpo.run_trl_grpo,
            "trl-kto": train_trl.run_trl_preference,
            "trl-reward": train_trl.run_trl_preference,
        }
        result = runners[spec["kind"]](spec)
    if "peak_mem_mb" not in result:
        result.update(probe.read())
    import torch

    result.update(
        peak_flops=peak,
        torch_threads=torch.get_num_threads(),  # OMP_NUM_THREADS, when the sweep set it
        status="ok",
        wall_s=time.perf_counter() - t0,
        arm=spec["arm"],
        rep=spec["rep"],
    )
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
