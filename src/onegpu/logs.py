"""Console logging for the CLI: our messages plain, third-party chatter quiet."""

from __future__ import annotations

import logging
import os

QUIET = ("httpx", "urllib3", "filelock", "datasets", "torchao", "torch.utils._pytree", "torch._dynamo",
         "torch._inductor", "DeepSpeed", "accelerate", "huggingface_hub")


def setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(message)s")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
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
