"""How `onegpu bench train` settles an arm's run Config before it trains: the dotted overrides,
and ``techniques.compile=auto`` decided as a run of realistic length decides it."""

from __future__ import annotations

import copy

from onegpu.bench.settings import BenchTrainConfig


def settle_compile(config: dict, device_type: str) -> dict:
    """An SFT arm's ``techniques.compile=auto`` settled as `onegpu train` settles it in a run of
    realistic length (AUTO_MIN_STEPS or more) on a GPU: a bench runs 10-20 steps, which auto would
    leave eager, while a default run compiles; a peer compiled with the guide's flags would then
    be compared with our eager code. On a CPU the run's own length decides, as in `onegpu train`
    (the committed 24-step CPU table runs eager; the 60-step headline compiles). DPO and GRPO keep
    auto by the run's length. The compile happens in the untimed first steps; the report gives
    its cost as each arm's start-up seconds."""
    t = config["techniques"]
    if (
        t.get("compile") != "auto"
        or device_type != "cuda"
        or config["training"].get("objective", "sft") != "sft"
    ):
        return config
    from onegpu.techniques.compile import AUTO_MIN_STEPS, auto_compiles

    long_run = apply_overrides(
        config, {"training.max_steps": max(config["training"]["max_steps"], AUTO_MIN_STEPS)}
    )
    mode = "default" if auto_compiles(_config(long_run), device_type) else "off"
    return apply_overrides(config, {"techniques.compile": mode})


def baseline_compiles(b: BenchTrainConfig, device_type: str) -> bool:
    """Whether the baseline arm runs compiled on this device (settle_compile, or auto by length)."""
    from onegpu.config import to_dict
    from onegpu.techniques.compile import auto_compiles

    config = settle_compile({k: v for k, v in to_dict(b).items() if k != "bench"}, device_type)
    mode = config["techniques"]["compile"]
    return mode not in ("off", "auto") or auto_compiles(_config(config), device_type)


def _config(config: dict):
    from onegpu.config import from_dict

    return from_dict(config)


def apply_overrides(config: dict, overrides: dict) -> dict:
    """A copy of ``config`` with dotted keys ("techniques.compile") set to the values given."""
    out = copy.deepcopy(config)
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
