"""Train with this process's GPU memory capped, to show what fits only with offload.

python tests/dist_scripts/capped_train.py <GiB> config.yaml
"""

import logging
import sys

import torch

from onegpu import train
from onegpu.config import from_dict, load_yaml
from onegpu.training.state import Callback


class StateDevices(Callback):
    """Where the optimizer's state tensors live once training ends (the offload's evidence)."""

    def __init__(self):
        self.devices, self.optimizer = set(), ""

    def on_train_end(self, run, state):
        opt = run.optimizer
        while (
            hasattr(opt, "optimizer") and opt.optimizer is not opt
        ):  # Accelerate / DeepSpeed wrappers
            opt = opt.optimizer
        self.optimizer = type(opt).__name__
        self.devices = {
            v.device.type for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
        }


def main(cap_gib: float, path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    watch = StateDevices()
    train(from_dict(load_yaml(path)), callbacks=[watch])
    print(f"peak_gib={torch.cuda.max_memory_allocated() / 2**30:.2f}")
    print(f"optimizer={watch.optimizer} state_devices={','.join(sorted(watch.devices)) or 'none'}")


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
