"""Run several trainings one after another in the same launched process group.

    torchrun --nproc-per-node 2 tests/dist_scripts/train_many.py a.yaml b.yaml

Starting the processes (imports, process group) costs more than a tiny run, so the distributed
tests chain a run and its resume in one launch.
"""

import logging
import sys

from onegpu import train
from onegpu.config import from_dict, load_yaml


def main(paths: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in paths:
        train(from_dict(load_yaml(path)))


if __name__ == "__main__":
    main(sys.argv[1:])
