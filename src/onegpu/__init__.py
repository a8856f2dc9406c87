"""onegpu: train and serve transformer models as fast as one GPU allows."""

__version__ = "0.1.0"

__all__ = ["train", "Config", "__version__"]


def train(config=None, callbacks=()):
    """Run a training job end to end: the library entry point behind `onegpu train`.

    ``config`` is a ``Config`` or a nested dict with the YAML's keys (not modified). With
    ``plan: auto`` the planner first settles the setup by measuring the best candidates on this
    device, then the run trains with it. ``callbacks`` (``onegpu.training.state.Callback``) observe
    the loop. Returns a ``RunResult``.
    """
    import copy

    from onegpu.config import Config, from_dict, validate
    from onegpu.training.run import run_training

    cfg = validate(copy.deepcopy(config) if isinstance(config, Config) else from_dict(config or {}))
    from onegpu.training import rl_default, tool_default

    if tool_default.is_tool_job(cfg):  # the calculator, no model, no data: its warm-up's model
        cfg = validate(
            tool_default.settle(cfg, lambda base: run_training(validate(base)).final_dir)
        )
    if rl_default.is_default_job(cfg):  # GRPO with no model and no data: the default job's model
        cfg = validate(rl_default.settle(cfg, lambda base: run_training(validate(base)).final_dir))
    if cfg.plan == "auto":  # plan before train: settle the setup by measurement
        from onegpu.plan.probe import auto_plan

        cfg = validate(auto_plan(cfg))
    return run_training(cfg, tuple(callbacks))


def __getattr__(name):
    # Lazy, so `import onegpu` (and `onegpu --help`) stays fast: torch/transformers load on use.
    if name == "Config":
        from onegpu.config import Config

        return Config
    raise AttributeError(name)
