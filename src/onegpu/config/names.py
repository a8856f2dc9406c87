"""Names users get wrong: the flag or config key a mistyped one most likely meant, the same for
the command line (cli/args.py) and YAML files or dicts (io.py), with the names other trainers use
for our settings."""

from __future__ import annotations

import dataclasses
import difflib
from typing import get_type_hints

# Names users bring from other trainers (HF TrainingArguments, TRL, Axolotl) -> our flag.
ALIASES = {
    "learning_rate": "training.lr",
    "lr_rate": "training.lr",
    "batch_size": "training.micro_batch_size",
    "per_device_train_batch_size": "training.micro_batch_size",
    "micro_batch": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.grad_accum",
    "grad_accumulation": "training.grad_accum",
    "steps": "training.max_steps",
    "num_steps": "training.max_steps",
    "warmup": "training.warmup_steps",
    "seed": "training.seed",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "seq_length": "data.seq_len",
    "sequence_len": "data.seq_len",
    "dataset": "data.path",
    "data_path": "data.path",
    "output_dir": "output.dir",
    "resume_from_checkpoint": "output.resume",
    "model_name_or_path": "model.name",
    "model_name": "model.name",
    "gradient_checkpointing": "techniques.checkpointing",
    "optim": "techniques.optimizer",
    "lora_r": "techniques.lora.r",
    "lora_alpha": "techniques.lora.alpha",
}


def suggest_flag(flag: str, options: list[str]) -> str | None:
    """The flag a mistyped one most likely meant. The field is matched within its own section
    first (comparing whole flags lets the shared '--training.' prefix outweigh the field name:
    'learnig_rate' would match 'eval_batches'), together with the names other trainers use."""
    flags = {o[2:]: o for o in options}
    section, _, name = flag.lstrip("-").rpartition(".")
    sections = sorted({f.split(".")[0] for f in flags if "." in f})
    if section and section.split(".")[0] not in sections:  # '--traning.lr': fix the section first
        close = difflib.get_close_matches(section.split(".")[0], sections, n=1, cutoff=0.6)
        section = ".".join(close[:1] + section.split(".")[1:]) if close else section
    aliases = {
        alias: f"--{target}" for alias, target in ALIASES.items() if f"--{target}" in options
    }

    def match(names: dict[str, str]) -> str | None:
        close = difflib.get_close_matches(
            name, list(names), n=1, cutoff=0.75 if len(name) <= 4 else 0.6
        )
        return names[close[0]] if close else None

    in_section = {
        f[len(section) + 1 :]: o
        for f, o in flags.items()
        if section and f.startswith(section + ".")
    }
    same_section_aliases = {a: o for a, o in aliases.items() if o.startswith(f"--{section}.")}
    for names in (
        in_section | same_section_aliases,  # the same section, its own fields and aliases
        {f.rpartition(".")[2]: o for f, o in flags.items()} | aliases,
    ):  # any section
        found = match(names)
        if found:
            return found
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.8)
    return close[0] if close else None


def dotted_fields(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of a config dataclass as a dotted key (``training.lr``,
    ``techniques.lora.r``), under ``prefix``."""
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += dotted_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def suggest_key(key: str, cls: type, prefix: str = "") -> str | None:
    """The dotted key a mistyped ``key`` (itself dotted, under ``prefix``) of the config dataclass
    ``cls`` most likely meant: the command line's suggestion for the same flag."""
    options = [f"--{k}" for k in dotted_fields(cls, prefix)]
    found = suggest_flag(f"--{key}", options)
    return found[2:] if found else None
