"""Train with this process's GPU memory capped, to show what fits only with offload.

    python tests/dist_scripts/capped_train.py <GiB> config.yaml
"""

import logging
import sys

import torch

from onegpu.config import from_dict, load_yaml
from onegpu.train import train


def main(cap_gib: float, path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    train(from_dict(load_yaml(path)))
    print(f"peak_gib={torch.cuda.max_memory_allocated() / 2**30:.2f}")


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
