"""Console logging for the CLI: our messages plain, third-party chatter quiet."""

from __future__ import annotations

import logging
import os
import sys

QUIET = (
    "httpx",
    "urllib3",
    "filelock",
    "datasets",
    "torchao",
    "torch.utils._pytree",
    "torch._dynamo",
    "torch._inductor",
    "DeepSpeed",
    "accelerate",
    "huggingface_hub",
)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is *now*: a handler that captured an old stream (replaced by
    an embedding program or a test harness) would fail on every later message."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(verbose: bool = False) -> None:
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        root.addHandler(_StderrHandler())
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    # datasets logs its own ERROR for unreadable files, which our DataError then explains with a
    # fix.
    logging.getLogger("datasets").setLevel(logging.INFO if verbose else logging.CRITICAL)
    # DeepSpeed (imported by transformers/accelerate when installed) warns on every CPU start.
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    if not verbose:
        try:
            import datasets

            datasets.disable_progress_bars()  # we print one summary line per data stage instead
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
