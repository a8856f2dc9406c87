"""Learning rate, warm-up and weight decay by training mode: what `auto` means for each.

A model trained from scratch and a pretrained model being fine-tuned want very different numbers
(a from-scratch learning rate wrecks a pretrained model's weights), so these three default to
`auto` and are settled here, once, from the mode: where a run starts (``training.run``), in the
planner's recommended config and in the benchmark's base config. The settled config holds plain
numbers, so the run's config.yaml records what was trained with and resumes with exactly that.
"""

from __future__ import annotations

import copy
import math

from onegpu.config import Config, TrainingConfig, validate
from onegpu.errors import ConfigError

LABELS = {
    "scratch": "training from scratch",
    "full": "full fine-tune of a pretrained model",
    "lora": "LoRA fine-tune of a pretrained model",
    "qlora": "QLoRA fine-tune of a pretrained model",
}


def auto_table() -> dict[str, dict]:
    """The values `auto` takes, per mode (warm-up as steps, or as a ratio of training.max_steps).

    - scratch: onegpu's own defaults for its presets (lr 2e-3, 20 warm-up steps, weight decay 0.1),
      kept so that a from-scratch run trains exactly as it always has.
    - full: Stanford Alpaca's fine-tuning command (github.com/tatsu-lab/stanford_alpaca, README,
      "Fine-tuning"): --learning_rate 2e-5 --weight_decay 0. --warmup_ratio 0.03, cosine schedule.
    - lora / qlora: the QLoRA recipe (Dettmers et al. 2023, arXiv:2305.14314; the authors' scripts
      github.com/artidoro/qlora scripts/finetune_guanaco_7b.sh and _13b.sh): --learning_rate 0.0002
      --weight_decay 0.0 --warmup_ratio 0.03. Plain LoRA takes the same numbers: in both only the
      adapters train, and the quantized base changes nothing about their optimisation.
    """
    adapters = {"lr": 2e-4, "warmup_steps": None, "warmup_ratio": 0.03, "weight_decay": 0.0}
    return {
        "scratch": {"lr": 2e-3, "warmup_steps": 20, "warmup_ratio": None, "weight_decay": 0.1},
        "full": {"lr": 2e-5, "warmup_steps": None, "warmup_ratio": 0.03, "weight_decay": 0.0},
        "lora": dict(adapters),
        "qlora": dict(adapters),
    }


def preference_table() -> dict[str, dict]:
    """`auto` for training.objective dpo / orpo / simpo, which start from a tuned model and move it
    less:

    - full: TRL's DPOConfig default learning rate 1e-6 (trl/trainer/dpo_config.py), with the 10%
      warm-up of the alignment-handbook's DPO recipes (recipes/zephyr-7b-beta/dpo/config_full.yaml);
    - lora / qlora: the alignment-handbook's QLoRA DPO recipe
      (recipes/zephyr-7b-beta/dpo/config_qlora.yaml): lr 5e-6, warm-up ratio 0.1;
    - scratch (a preset, as in the default job): 5e-4 with 10% warm-up, onegpu's own choice: a
      randomly initialised model has no prior to stay near, and at 1e-6 its rewards would not move.
    No weight decay in any: the recipes use none.
    """
    return {
        "scratch": {"lr": 5e-4, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
        "full": {"lr": 1e-6, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
        "lora": {"lr": 5e-6, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
        "qlora": {"lr": 5e-6, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
    }


def reward_table() -> dict[str, dict]:
    """`auto` for training.objective reward (a reward model: a new score head on the model):

    - full / lora / qlora: TRL's RewardConfig default learning rate 1e-4
      (trl/trainer/reward_config.py: "Defaults to 1e-4 instead of 5e-5"), no warm-up and no weight
      decay (TrainingArguments' defaults, which RewardConfig keeps); DPO's 1e-6 would leave the
      new head where it started;
    - scratch (a preset): the preference objectives' 5e-4 with 10% warm-up.
    """
    tuned = {"lr": 1e-4, "warmup_steps": 0, "warmup_ratio": None, "weight_decay": 0.0}
    return {
        "scratch": {"lr": 5e-4, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
        "full": dict(tuned),
        "lora": dict(tuned),
        "qlora": dict(tuned),
    }


def grpo_table() -> dict[str, dict]:
    """`auto` for training.objective grpo:

    - full: TRL's GRPOConfig defaults (trl/trainer/grpo_config.py): learning_rate 1e-6, no warm-up
      and no weight decay (TrainingArguments' defaults, which GRPOConfig keeps);
    - lora / qlora: Unsloth's GRPO notebooks (unslothai/notebooks, e.g.
      Llama3.1_(8B)-GRPO.ipynb): learning_rate 5e-6, warmup_ratio 0.1, weight_decay 0.1;
    - scratch (a preset): 1e-4 with 10% warm-up, onegpu's own choice, as for the preference
      objectives: a small model trained from scratch has no tuned prior to stay near.
    """
    return {
        "scratch": {"lr": 1e-4, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.0},
        "full": {"lr": 1e-6, "warmup_steps": 0, "warmup_ratio": None, "weight_decay": 0.0},
        "lora": {"lr": 5e-6, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.1},
        "qlora": {"lr": 5e-6, "warmup_steps": None, "warmup_ratio": 0.1, "weight_decay": 0.1},
    }


def training_mode(cfg: Config, model_name: str | None = None) -> str:
    """scratch, full, lora or qlora. With adapters the adapters set the mode (they are what trains);
    otherwise a preset or model.from_scratch is from scratch. "auto" always names a preset."""
    lora = cfg.techniques.lora
    if lora.enabled:
        return "qlora" if lora.quantize_base != "none" else "lora"
    from onegpu import models

    name = model_name or cfg.model.name
    return (
        "scratch" if name == "auto" or models.is_preset(name) or cfg.model.from_scratch else "full"
    )


def warmup_steps_of(t: TrainingConfig, ratio: float) -> int:
    """Steps of a warm-up given as a share of max_steps, rounded up as HF Trainer does
    (TrainingArguments.get_warmup_steps: ceil(steps x ratio)); rounded first so 0.03 x 200 is 6."""
    return math.ceil(round(ratio * t.max_steps, 9))


def _settle(cfg: Config, model_name: str | None) -> tuple[str, dict, dict]:
    """(mode, concrete values, where each came from: "auto" or "set")."""
    t = cfg.training
    if t.warmup_steps != "auto" and t.warmup_ratio is not None:
        raise ConfigError(
            f"training.warmup_steps={t.warmup_steps} and training.warmup_ratio={t.warmup_ratio} "
            "both set the warm-up.",
            hint="keep one of them (the other stays auto)",
        )
    if t.warmup_ratio is not None and not 0.0 <= t.warmup_ratio < 1.0:
        raise ConfigError(
            f"training.warmup_ratio must be in [0, 1), got {t.warmup_ratio}.",
            hint="set training.warmup_ratio to e.g. 0.03, or use training.warmup_steps",
        )
    mode = training_mode(cfg, model_name)
    objective = cfg.training.objective
    table = {"sft": auto_table, "grpo": grpo_table, "reward": reward_table}.get(
        objective, preference_table
    )
    auto = table()[mode]
    values, source = {}, {}
    for key in ("lr", "weight_decay"):
        value = getattr(t, key)
        values[key], source[key] = (auto[key], "auto") if value == "auto" else (value, "set")
    if t.warmup_steps != "auto":
        values["warmup_steps"], values["warmup_ratio"], source["warmup"] = (
            t.warmup_steps,
            None,
            "set",
        )
    elif t.warmup_ratio is not None:
        values["warmup_steps"], values["warmup_ratio"], source["warmup"] = (
            None,
            t.warmup_ratio,
            "set",
        )
    else:
        values["warmup_steps"], values["warmup_ratio"], source["warmup"] = (
            auto["warmup_steps"],
            auto["warmup_ratio"],
            "auto",
        )
    return mode, values, source


def resolve_hyperparameters(cfg: Config, model_name: str | None = None) -> Config:
    """A checked copy of cfg with lr, warm-up and weight decay as plain numbers: `auto` by the mode
    (see auto_table), a warm-up ratio as steps of this run. Values already numbers are kept, so
    settling a settled config changes nothing (a resumed run trains with what it started with)."""
    _, values, _ = _settle(cfg, model_name)
    out = copy.deepcopy(cfg)
    t = out.training
    t.lr, t.weight_decay = values["lr"], values["weight_decay"]
    ratio = values["warmup_ratio"]
    t.warmup_steps = warmup_steps_of(t, ratio) if ratio is not None else values["warmup_steps"]
    t.warmup_ratio = None  # the steps above are what trains: one warm-up setting in effect
    return validate(out)


def describe(cfg: Config, model_name: str | None = None) -> str:
    """One line for the start of a run: the mode and each value, and whether auto chose it."""
    mode, values, source = _settle(cfg, model_name)
    ratio = values["warmup_ratio"]
    if ratio is not None:
        warmup = f"{ratio * 100:g}% = {warmup_steps_of(cfg.training, ratio)} steps"
    else:
        warmup = f"{values['warmup_steps']} steps"
    label = LABELS[mode] + (
        "" if cfg.training.objective == "sft" else f", {cfg.training.objective.upper()}"
    )
    return (
        f"hyper-parameters ({label}): lr {_num(values['lr'])} ({source['lr']}), warm-up {warmup} "
        f"({source['warmup']}), weight decay {_num(values['weight_decay'])} "
        f"({source['weight_decay']})"
    )


def _num(x: float) -> str:
    """2e-4 rather than 0.0002: learning rates read in powers of ten."""
    if 0 < abs(x) < 0.01:
        mantissa, exp = f"{x:e}".split("e")
        return f"{float(mantissa):g}e{int(exp)}"
    return f"{x:g}"


def bare(t: TrainingConfig) -> TrainingConfig:
    """A training section on its own (an optimizer built outside a run: the planner's accuracy check
    on randomly initialised models, tests) has no model or method to choose by; its `auto` values
    take the from-scratch entry, which is what such a randomly initialised model is."""
    if (
        t.lr != "auto"
        and t.weight_decay != "auto"
        and t.warmup_steps != "auto"
        and t.warmup_ratio is None
    ):
        return t
    return resolve_hyperparameters(Config(training=t), "auto").training
