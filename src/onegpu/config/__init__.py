"""The run configuration: typed sections (sections.py), whole-config checks (checks.py), dicts and
YAML (io.py)."""

from onegpu.config.checks import NON_NEGATIVE, OFFLOAD_OPTIMIZERS, POSITIVE_INTS, validate
from onegpu.config.grpo import GRPOConfig
from onegpu.config.io import SECRET_PATTERN, from_dict, load_yaml, redact, save_yaml, to_dict
from onegpu.config.sections import (
    Config,
    DataConfig,
    DistributedConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    PreferenceConfig,
    TechniquesConfig,
    TrainingConfig,
)

__all__ = [
    "Config",
    "DataConfig",
    "DistributedConfig",
    "GRPOConfig",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "PreferenceConfig",
    "TechniquesConfig",
    "TrainingConfig",
    "validate",
    "POSITIVE_INTS",
    "NON_NEGATIVE",
    "OFFLOAD_OPTIMIZERS",
    "from_dict",
    "to_dict",
    "load_yaml",
    "save_yaml",
    "redact",
    "SECRET_PATTERN",
]
