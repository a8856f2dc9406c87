"""The default GRPO job (`onegpu train --training.objective grpo`, no model, no data): online RL on
the default job's model, offline.

Its model is the newest default run's ``final/`` under output.dir (a run of the default job: the
preset model, the standard library's source, SFT, no adapters); without one, the default job runs
first. Its prompts are the starts of standard-library functions and classes, and its reward
(rewards.python_continues) checks, by compiling, that the completion continues them into valid
Python. Settings the user left at their defaults take values sized for a CPU: a run of a few
minutes in which the reward rises.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

from onegpu.config import Config, GRPOConfig, TrainingConfig, load_yaml

log = logging.getLogger(__name__)

# (section, field, value) the default GRPO job changes where the user left the default
# (measured on the 2-core CPU: the validation reward of the stdlib prompts rises from 0.09 to 0.26
# in these 60 steps; at lr 2e-5 or with half the prompts a step it stays within noise)
DEFAULT_JOB = (
    ("training", "micro_batch_size", 16),  # 16 completions: 2 prompts x 8 a micro-batch
    ("training", "grad_accum", 2),  # 4 prompts a step
    ("training", "max_steps", 60),
    ("training", "lr", 2e-4),
    ("training", "warmup_steps", 0),
    ("training", "eval_every", 15),
    ("training", "eval_batches", 8),  # 16 validation prompts x 8 completions
    ("training", "log_every", 5),
    ("grpo", "max_completion_length", 32),
    ("data", "seq_len", 128),
)


def is_default_job(cfg: Config) -> bool:
    return cfg.training.objective == "grpo" and cfg.model.name == "auto" and cfg.data.path is None


def settle(cfg: Config, train_default=None) -> Config:
    """The config with the default job's model (and CPU-sized settings) filled in; other configs
    unchanged. ``train_default(cfg) -> final folder`` runs the default job when none exists."""
    if not is_default_job(cfg):
        return cfg
    out = copy.deepcopy(cfg)
    final = newest_default_final(Path(cfg.output.dir))
    if final is None:
        log.info(
            "GRPO default job: no default run under %s yet; running the default job first",
            cfg.output.dir,
        )
        base = Config()
        base.output = dataclasses.replace(cfg.output, name=None, resume=None, overwrite=False)
        final = Path(train_default(base))
    log.info("GRPO default job: policy %s", final)
    out.model.name = str(final)
    defaults = {"training": TrainingConfig(), "grpo": GRPOConfig(), "data": type(cfg.data)()}
    for section, name, value in DEFAULT_JOB:
        part = getattr(out, section)
        if getattr(part, name) == getattr(defaults[section], name):
            setattr(part, name, value)
    return out


def newest_default_final(runs: Path) -> Path | None:
    """The ``final/`` of the newest finished run of the default job under ``runs``."""
    found = []
    for config in runs.glob("*/config.yaml"):
        final = config.parent / "final"
        if not (final / "config.json").is_file():
            continue
        try:
            saved = load_yaml(config)
        except Exception:  # noqa: BLE001 - an unreadable config is not a default run
            continue
        if _is_default_run(saved):
            found.append((final.stat().st_mtime, final))
    return max(found)[1] if found else None


def _is_default_run(saved: dict) -> bool:
    model, data = saved.get("model") or {}, saved.get("data") or {}
    training, techniques = saved.get("training") or {}, saved.get("techniques") or {}
    return (
        model.get("name", "auto") == "auto"
        and data.get("path") is None
        and training.get("objective", "sft") == "sft"
        and not (techniques.get("lora") or {}).get("enabled", False)
    )
