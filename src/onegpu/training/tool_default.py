"""The built-in tool-use job (`onegpu train --training.objective grpo --grpo.tools calculator`, no
model, no data): multi-turn GRPO with the calculator (objectives/calculator.py), offline.

A tiny model first learns the dialogue's shape on warm-up conversations made here (SFT; a
run of its own under output.dir, reused by later jobs): in half of them it calls the calculator
and copies its result, in the other half it guesses the answer's last two digits. Then GRPO asks
it new questions, with the calculator as its tool and calculator_answer as the reward (1 for the
exact value): the reward can rise only as far as the policy learns that calling the tool, and
copying what it says, pays. Settings the user left at their defaults take values sized for a CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
from pathlib import Path

from onegpu.config import Config, GRPOConfig, TrainingConfig, load_yaml
from onegpu.paths import cache_dir

log = logging.getLogger(__name__)

VERSION = "v1"  # of the generated files: a change to calculator.py's questions bumps it
WARMUP_DIALOGUES, PROMPTS, CALL_SHARE = 4000, 2000, 0.5
# the warm-up run (SFT of the tiny preset on the dialogues)
WARMUP = (
    ("training", "max_steps", 300),
    ("training", "micro_batch_size", 8),
    ("training", "lr", 2e-3),
    ("training", "eval_every", 100),
    ("data", "seq_len", 96),
    # one token a digit: copying the tool's result is then copying common tokens one by one, not
    # one rare token per number (merged, the numbers were ~1,000 multi-digit tokens, each seen ~15
    # times in the 4,000 dialogues)
    ("model", "split_digits", True),
    # eager: the dialogues' lengths vary, and on a loaded CPU compiling their shapes took longer
    # than the steps it would speed up
    ("techniques", "compile", "off"),
)
# (section, field, value) the GRPO job changes where the user left the default
JOB = (
    ("training", "micro_batch_size", 16),  # 2 questions x 8 conversations a step
    ("training", "max_steps", 40),
    ("training", "lr", 1e-4),
    ("training", "warmup_steps", 0),
    ("training", "eval_every", 10),
    ("training", "eval_batches", 2),
    ("training", "log_every", 5),
    ("grpo", "max_completion_length", 32),
    ("grpo", "tool_parser", "hermes"),
    ("data", "seq_len", 64),
)


def is_tool_job(cfg: Config) -> bool:
    return (
        cfg.training.objective == "grpo"
        and cfg.model.name == "auto"
        and cfg.data.path is None
        and "calculator" in cfg.grpo.tools
    )


def settle(cfg: Config, train_warmup) -> Config:
    """The config with the warm-up run's model, the questions and the reward filled in (and
    CPU-sized settings); other configs unchanged. ``train_warmup(cfg) -> final folder`` runs
    the warm-up when none exists."""
    if not is_tool_job(cfg):
        return cfg
    folder = cache_dir() / "calculator"
    warmup_file = _written(folder / f"warmup-{VERSION}.jsonl", _warmup_records)
    prompts_file = _written(folder / f"prompts-{VERSION}.jsonl", _prompt_records)
    final = newest_final(Path(cfg.output.dir), warmup_file)
    if final is None:
        log.info("calculator job: no warm-up run under %s yet; running it first", cfg.output.dir)
        base = Config()
        base.output = dataclasses.replace(cfg.output, name=None, resume=None, overwrite=False)
        base.data.path = str(warmup_file)
        for section, name, value in WARMUP:
            setattr(getattr(base, section), name, value)
        final = Path(train_warmup(base))
    log.info("calculator job: policy %s", final)
    out = copy.deepcopy(cfg)
    out.model.name = str(final)
    out.data.path = str(prompts_file)
    if not out.grpo.rewards:
        out.grpo.rewards = ["calculator_answer"]
    defaults = {"training": TrainingConfig(), "grpo": GRPOConfig(), "data": type(cfg.data)()}
    for section, name, value in JOB:
        part = getattr(out, section)
        if getattr(part, name) == getattr(defaults[section], name):
            setattr(part, name, value)
    return out


def _warmup_records(rng: random.Random) -> list[dict]:
    from onegpu.objectives.calculator import warmup_dialogue

    return [warmup_dialogue(rng, CALL_SHARE) for _ in range(WARMUP_DIALOGUES)]


def _prompt_records(rng: random.Random) -> list[dict]:
    from onegpu.objectives.calculator import prompt_record

    return [prompt_record(rng) for _ in range(PROMPTS)]


def _written(path: Path, make) -> Path:
    """``path``, written once (seeded: the same file every time), atomically."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = 0 if "warmup" in path.name else 1
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for record in make(random.Random(seed)):
                f.write(json.dumps(record) + "\n")
        tmp.replace(path)
    return path


def newest_final(runs: Path, warmup_file: Path) -> Path | None:
    """The ``final/`` of the newest finished warm-up run (trained on ``warmup_file`` with WARMUP's
    settings: one made before a change to them is not reused)."""
    found = []
    for config in runs.glob("*/config.yaml"):
        final = config.parent / "final"
        if not (final / "config.json").is_file():
            continue
        try:
            saved = load_yaml(config)
        except Exception:  # noqa: BLE001 - an unreadable config is not a warm-up run
            continue
        data, training = saved.get("data") or {}, saved.get("training") or {}
        if data.get("path") != str(warmup_file) or training.get("objective", "sft") != "sft":
            continue
        if all((saved.get(sec) or {}).get(name) == value for sec, name, value in WARMUP):
            found.append((final.stat().st_mtime, final))
    return max(found)[1] if found else None
