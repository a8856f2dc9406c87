"""The grpo section: online RL from verifiable rewards (training.objective grpo), and its checks.

Defaults are TRL's GRPOConfig (trl 1.16, trl/trainer/grpo_config.py) wherever TRL has the field, so
a recipe written for TRL means the same here; each field says where its default comes from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from onegpu.errors import ConfigError


@dataclass
class GRPOConfig:
    group_size: int = 8
    """Completions sampled per prompt (a group; advantages are rewards relative to the group). TRL's
    num_generations default, 8. training.micro_batch_size counts completions, and micro_batch_size
    x grad_accum (the completions of one step) must be a multiple of it."""
    max_completion_length: int = 512
    """Most tokens sampled per completion (TRL's default 512). Prompts are cut to data.seq_len."""
    temperature: float = 1.0
    """Sampling temperature (TRL's default 1.0); the loss's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (TRL's
    default 1.0 = all)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = all; TRL's default)."""
    sampler: Literal["engine", "generate", "continuous"] = "engine"
    """How rollouts are sampled (benchmarks/results/grpo-rollouts-cpu.md measures each). engine:
    onegpu's decode engine — each prompt prefilled once for its group, every completion decoded
    together in a static cache sized to the step, sampling on the device. generate: transformers'
    ``generate`` with a dynamic KV cache. continuous: transformers' continuous batching (a paged KV
    cache sized for the step's completions). On a CPU a small model samples on one thread."""
    policy_off: Optional[str] = None
    """sampler engine: rows of the engine's device policy table to switch off, comma-separated
    (ROW[,ROW]; the rows and why each is on: `onegpu doctor`)."""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """How per-token losses are aggregated. dapo (TRL's default since 0.20; Yu et al. 2025): summed
    over the tokens of the step, divided by that token count. grpo (Shao et al. 2024): each
    completion's mean over its tokens, averaged over completions (favours short right answers).
    dr_grpo (Liu et al. 2025): summed, divided by completions x max_completion_length."""
    epsilon: float = 0.2
    """Clip range of the probability ratio, lower side (TRL's default 0.2; PPO's)."""
    epsilon_high: Optional[float] = None
    """Upper clip range (default: epsilon; DAPO recommends 0.28, "clip-higher")."""
    beta: float = 0.0
    """KL coefficient against the reference model. 0 (TRL's default; DAPO, Dr. GRPO) loads no
    reference at all; DeepSeek-R1 used 0.001."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The probability ratio against the rollout (TRL's name and default, token). token: one ratio
    per token. sequence: GSPO (Zheng et al. 2025), one ratio per completion, the exp of the mean
    of its tokens' log-ratios, clipped and applied to each of its tokens (more stable for MoE
    policies)."""
    sampler_correction: Literal["off", "tis", "mis"] = "off"
    """Correct for the sampler's own numerics (the engine's compiled, paged step against the
    training forward; TRL's vllm_importance_sampling_correction): each token's loss times the
    ratio p_train / p_sampler of the policy at sampling, truncated at sampler_correction_max (tis)
    or zeroed above it (mis). Needs the engine sampler at temperature 1 without top-k/top-p (its
    log-probs are the model's own distribution). The mismatch is logged every step either way
    (sampler_logp_diff_mean/max, sampler_kl) when the engine samples at temperature 1."""
    sampler_correction_level: Literal["token", "sequence"] = "sequence"
    """The correction's ratio per token, or per completion (the exp of the sum of its tokens'
    log-ratios); TRL's default mode is sequence_mask."""
    sampler_correction_max: float = 3.0
    """The ratio's cap (TRL's vllm_importance_sampling_clip_max, default 3.0)."""
    kl_ratio: bool = True
    """Multiply the KL term by the probability ratio against the rollout, so its gradient is the
    unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl, default true). It
    changes the gradient even on-policy, where the ratio is 1 but differentiable."""
    reference: Literal["auto", "adapters", "copy"] = "auto"
    """The reference with beta > 0. adapters: with LoRA, the base is the policy with its adapters
    off (no copy); copy: a frozen copy of the starting model. auto: adapters with LoRA, else
    copy."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages: reward minus its group's mean, divided by the group's std (group; TRL's default),
    by the std over the step's completions (batch), or not divided (none; Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer steps per batch of rollouts (TRL's mu, default 1); from the second on, the ratio
    against the rollout's own log-probs is clipped."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length out of the loss (TRL's default false; DAPO
    recommends true)."""
    rewards: list[str] = field(default_factory=list)
    """Reward functions: built-in names (exact_match, format, length, python_compiles,
    python_continues), module:function references with TRL's signature f(prompts,
    completions, **columns) -> list[float | None], and/or the folders of trained reward models
    (training.objective reward; scored in this process, batched). Default job: python_continues."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (default: 1 each); the total reward is the weighted sum."""
    answer_field: str = "answer"
    """Column the exact_match reward compares completions with."""
    format_pattern: str = r"(?s)^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
    """Regular expression the format reward requires a completion to match (whole completion)."""
    tools: list[str] = field(default_factory=list)
    """Functions the policy may call during a rollout (multi-turn; objectives/multiturn.py):
    module:function references, or the built-in calculator. Each call the model writes in its
    tool format (grpo.tool_parser) runs in a subprocess, its text result is appended as a tool
    message and the model goes on, for up to grpo.max_turns turns. Empty: one turn, no tools."""
    max_turns: int = 3
    """With grpo.tools: the most model turns of a rollout (each up to grpo.max_completion_length
    tokens; a tool's result is cut to as many). A turn without a tool call ends it."""
    tool_timeout: float = 10.0
    """With grpo.tools: seconds a tool call may run; past them its process is killed and the
    model reads an error instead of a result."""
    tool_parser: Literal["auto", "hermes", "llama3"] = "auto"
    """With grpo.tools: the format the model writes calls in (the formats `onegpu serve` reads).
    auto: the one the chat template shows."""

    def completion_tokens(self) -> int:
        """The most tokens after a prompt: a completion, or with tools a conversation of
        max_turns turns and the tool results between them, each cut to a turn's length (the
        chat template's few tokens around each result aside)."""
        turns = self.max_turns if self.tools else 1
        return self.max_completion_length * (2 * turns - 1)


def check_grpo(cfg) -> None:
    """The grpo section's ranges, and the fields of one objective set for another."""
    g, t, objective = cfg.grpo, cfg.training, cfg.training.objective
    if objective != "grpo":
        changed = _changed(g, GRPOConfig())
        if changed:
            raise ConfigError(
                f"grpo.{changed[0]} is set, but training.objective={objective}.",
                hint="drop the grpo.* settings, or set --training.objective grpo",
            )
        return
    changed = _changed(cfg.preference, type(cfg.preference)())
    if changed:
        raise ConfigError(
            f"preference.{changed[0]} is a setting of the preference objectives (dpo / orpo / "
            "simpo), but training.objective=grpo.",
            hint="drop it; GRPO's settings are in the grpo section (e.g. grpo.beta, "
            "grpo.reference)",
        )
    rules = [
        (
            g.group_size < 2,
            "grpo.group_size",
            g.group_size,
            ">= 2",
            "set grpo.group_size to e.g. 8: an advantage is a reward relative to the rest of its "
            "group, so alone each is 0",
        ),
        (
            g.max_completion_length < 1,
            "grpo.max_completion_length",
            g.max_completion_length,
            ">= 1",
            "set grpo.max_completion_length to e.g. 256",
        ),
        (g.temperature <= 0, "grpo.temperature", g.temperature, "> 0", "set e.g. 1.0"),
        (not 0 < g.top_p <= 1, "grpo.top_p", g.top_p, "in (0, 1]", "set e.g. 1.0"),
        (g.top_k < 0, "grpo.top_k", g.top_k, ">= 0 (0 = off)", "set 0"),
        (g.epsilon < 0, "grpo.epsilon", g.epsilon, ">= 0", "set e.g. 0.2"),
        (
            g.epsilon_high is not None and g.epsilon_high < 0,
            "grpo.epsilon_high",
            g.epsilon_high,
            ">= 0",
            "set e.g. 0.28, or leave it unset",
        ),
        (g.beta < 0, "grpo.beta", g.beta, ">= 0", "set 0 (no reference) or e.g. 0.001"),
        (g.num_iterations < 1, "grpo.num_iterations", g.num_iterations, ">= 1", "set 1"),
        (
            g.sampler_correction_max <= 0,
            "grpo.sampler_correction_max",
            g.sampler_correction_max,
            "> 0",
            "set e.g. 3.0",
        ),
    ]
    for bad, name, value, must, fix in rules:
        if bad:
            raise ConfigError(f"{name} must be {must}, got {value}.", hint=fix)
    per_step = t.micro_batch_size * t.grad_accum
    if per_step % g.group_size:
        raise ConfigError(
            f"training.micro_batch_size x training.grad_accum = {per_step} completions per step is "
            f"not a multiple of grpo.group_size={g.group_size}: a group would be split between "
            "steps.",
            hint=f"make micro_batch_size x grad_accum a multiple of {g.group_size}",
        )
    own = g.sampler == "engine" and g.temperature == 1 and g.top_k == 0 and g.top_p == 1
    if g.sampler_correction != "off" and not own:
        raise ConfigError(
            f"grpo.sampler_correction={g.sampler_correction} needs the sampler's log-probs of the "
            "distribution it sampled: the engine's are the model's own, so grpo.sampler=engine at "
            "temperature 1 with top_k 0 and top_p 1.",
            hint="set those, or grpo.sampler_correction=off",
        )
    if g.policy_off and g.sampler != "engine":
        raise ConfigError(
            f"grpo.policy_off={g.policy_off} switches rows of the engine's policy, but "
            f"grpo.sampler={g.sampler} samples without the engine.",
            hint="drop grpo.policy_off, or set grpo.sampler=engine",
        )
    if g.reference == "adapters" and not cfg.techniques.lora.enabled:
        raise ConfigError(
            "grpo.reference=adapters needs LoRA: the reference is the base model with the adapters "
            "switched off.",
            hint="add --techniques.lora.enabled true, or set grpo.reference=copy",
        )
    if g.reference != "auto" and g.beta == 0:
        raise ConfigError(
            f"grpo.reference={g.reference} is set, but grpo.beta=0 uses no reference model.",
            hint="set grpo.beta > 0 (e.g. 0.001), or drop grpo.reference",
        )
    if g.reward_weights is not None and len(g.reward_weights) != len(g.rewards):
        raise ConfigError(
            f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.rewards)} reward "
            "functions.",
            hint="give one weight per entry of grpo.rewards, or drop grpo.reward_weights",
        )
    if t.save_every and t.save_every % g.num_iterations:
        raise ConfigError(
            f"training.save_every={t.save_every} is not a multiple of grpo.num_iterations="
            f"{g.num_iterations}: a checkpoint would fall inside a batch of rollouts still in use.",
            hint=f"set training.save_every to a multiple of {g.num_iterations}",
        )
    check_tools(g)
    if cfg.data.format not in ("auto",):
        raise ConfigError(
            f"training.objective=grpo reads prompts, but data.format={cfg.data.format}.",
            hint="set data.format=auto: GRPO needs a prompt column (text or chat messages)",
        )


def check_tools(g: GRPOConfig) -> None:
    """grpo.tools and the settings that go with it."""
    from onegpu.objectives.tools import BUILTIN_TOOLS  # no heavy imports: names only

    unset = GRPOConfig()
    if not g.tools:
        for name in ("max_turns", "tool_timeout", "tool_parser"):
            if getattr(g, name) != getattr(unset, name):
                raise ConfigError(
                    f"grpo.{name} is set, but grpo.tools is empty: without tools a rollout is "
                    "one turn.",
                    hint="add --grpo.tools '[calculator]' (or a module:function), or drop "
                    f"grpo.{name}",
                )
        return
    for entry in g.tools:
        if entry not in BUILTIN_TOOLS and (":" not in entry or not all(entry.partition(":")[::2])):
            raise ConfigError(
                f"grpo.tools: '{entry}' is neither a built-in tool nor a module:function.",
                hint=f"built-ins: {', '.join(BUILTIN_TOOLS)}; or give e.g. my_tools:search",
            )
    if g.max_turns < 2:
        raise ConfigError(
            f"grpo.max_turns must be >= 2 with grpo.tools, got {g.max_turns}: one turn to call "
            "a tool, one to read its result.",
            hint="set grpo.max_turns to e.g. 3",
        )
    if g.tool_timeout <= 0:
        raise ConfigError(
            f"grpo.tool_timeout must be > 0 seconds, got {g.tool_timeout}.", hint="set e.g. 10"
        )
    if g.sampler != "engine":
        raise ConfigError(
            f"grpo.tools needs grpo.sampler=engine, got {g.sampler}: each turn goes on from the "
            "engine's prefix cache.",
            hint="set grpo.sampler=engine (the default)",
        )


def _changed(section, default) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(section)
        if getattr(section, f.name) != getattr(default, f.name)
    ]
