"""Where a training step's time goes, in our loop and in HF Trainer, on the same model and tokens.

    python benchmarks/profile_train.py                      # both loops, CPU defaults
    python benchmarks/profile_train.py --trainer onegpu --training.max_steps 8 --data.seq_len 512

Runs each loop under torch.profiler for `steps` optimizer steps (the first `warmup_steps` are not
recorded) and writes a short markdown summary: the top operators by self time, the time inside
the optimizer step and the data loader, and host synchronisations (`aten::_local_scalar_dense`,
i.e. `.item()`/`float(tensor)`) per step.
"""

from __future__ import annotations

import datetime as dt
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from onegpu.bench.train import BenchTrainConfig, apply_overrides, base_config, prepare

SYNC_OPS = ("aten::_local_scalar_dense",)
REGIONS = {"optimizer step": "Optimizer.step#", "data loader": "enumerate(DataLoader)#"}


@dataclass
class ProfileConfig(BenchTrainConfig):
    trainer: Literal["both", "onegpu", "hf"] = "both"
    """Which loop to profile."""
    top: int = 12
    """Operators listed per loop."""
    summary: str = "benchmarks/results/train-cpu-profile.md"
    """Markdown summary written here."""
    compile: Literal["auto", "default", "off"] = "default"
    """Our loop's techniques.compile. default: compiled, as a default run of 50+ steps is (auto
    would not compile a profile this short)."""


def profile_loop(kind: str, cfg: ProfileConfig, tmp: str):
    """Run one loop under the profiler; the recording covers steps warmup+1 .. steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from onegpu.bench import train_child as child

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    active = cfg.training.max_steps - cfg.bench.warmup_steps
    spec = {
        "arm": "hf-trainer" if kind == "hf" else "baseline",
        "kind": kind,
        "rep": 0,
        "config": apply_overrides(
            base_config(cfg, tmp), {"output.name": kind, "techniques.compile": cfg.compile}
        ),
        "warmup_steps": cfg.bench.warmup_steps,
        "budget_s": cfg.bench.max_seconds,
    }
    captured = []  # the recorded window's statistics, handed over when it closes
    with profile(
        activities=acts,
        schedule=schedule(wait=0, warmup=cfg.bench.warmup_steps, active=active),
        on_trace_ready=lambda p: captured.append(p.key_averages()),
    ) as prof:
        if kind == "hf":
            child.run_hf(spec, callbacks=(_hf_stepper(prof),))
        else:
            _run_ours_stepped(spec, prof)
    return captured[0] if captured else prof.key_averages(), active


def _run_ours_stepped(spec: dict, prof) -> None:
    """Advance the profiler after every optimizer step, through the loop's callbacks."""
    from onegpu.bench import train_child as child
    from onegpu.training.state import Callback

    class Stepper(Callback):
        def on_step_end(self, run, state):
            prof.step()

    child.run_onegpu(spec, callbacks=(Stepper(),))


def _hf_stepper(prof):
    from transformers import TrainerCallback

    class Stepper(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            prof.step()

    return Stepper()


def summarize(kind: str, events, steps: int, top: int) -> list[str]:
    per_step = lambda us: us / 1000 / max(steps, 1)  # noqa: E731  microseconds total -> ms per step
    step_total = sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep"))
    lines = [
        f"### {'onegpu train()' if kind == 'onegpu' else 'HF Trainer'}",
        "",
        f"{per_step(step_total):.1f} ms per step (profiled wall time, {steps} steps)",
        "",
    ]
    for label, prefix in REGIONS.items():
        inc = sum(e.cpu_time_total for e in events if e.key.startswith(prefix))
        lines.append(f"- {label}: {per_step(inc):.1f} ms/step ({inc / max(step_total, 1):.1%})")
    syncs = sum(e.count for e in events if e.key in SYNC_OPS)
    lines += [
        f"- host syncs (`.item()`-style): {syncs / max(steps, 1):.1f} per step",
        "",
        "| operator | self ms/step | share | calls/step |",
        "|---|---|---|---|",
    ]
    ops = sorted(
        (e for e in events if not e.key.startswith(("ProfilerStep", "Optimizer.", "enumerate("))),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )[:top]
    for e in ops:
        lines.append(
            f"| `{e.key}` | {per_step(e.self_cpu_time_total):.1f} | "
            f"{e.self_cpu_time_total / max(step_total, 1):.1%} | {e.count / max(steps, 1):.0f} |"
        )
    return lines + [""]


def main(argv: list[str]) -> int:
    from onegpu.cli.args import make_parser, parse

    cfg, _ = parse(
        make_parser("profile_train.py", __doc__.splitlines()[0], ProfileConfig), argv, ProfileConfig
    )
    kinds = ["onegpu", "hf"] if cfg.trainer == "both" else [cfg.trainer]
    setup = prepare(cfg)  # tokenize once, so neither profile pays for it
    lines = [
        f"# Training step profile ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"`python benchmarks/profile_train.py {' '.join(argv)}`".replace(" `", "`"),
        "",
        f"Model {setup['model_name']} ({setup['params'] / 1e6:.2f} M params), seq "
        f"{cfg.data.seq_len}, {cfg.training.micro_batch_size} x {cfg.training.grad_accum} "
        "sequences per step, fp32 unless set.",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="onegpu-profile-") as tmp:
        for kind in kinds:
            events, steps = profile_loop(kind, cfg, tmp)
            lines += summarize(kind, events, steps, cfg.top)
    out = Path(cfg.summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
