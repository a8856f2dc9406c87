"""onegpu: train and serve transformer models as fast as one GPU allows."""

__version__ = "0.1.0"

__all__ = ["train", "Config", "__version__"]


def __getattr__(name):
    # Lazy, so `import onegpu` (and `onegpu --help`) stays fast: torch/transformers load on use.
    if name == "train":
        import importlib

        return importlib.import_module("onegpu.train")  # callable: onegpu.train(config) runs a job
    if name == "Config":
        from onegpu.config import Config

        return Config
    raise AttributeError(name)
