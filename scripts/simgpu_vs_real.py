"""On a CUDA GPU: the simulated peak beside the real one, for the same setups.

    python scripts/simgpu_vs_real.py          # (scripts/gpu_check.sh runs it as the `simpeak` step)

For each setup (the tests/gpu/test_gpu_plan.py Llama case: hidden 512, 6 layers, 4 x 1024 tokens,
bf16; checkpointing off / full / every-n) one optimizer step is measured twice: as the simulated
tier measures it (tests/simgpu/fullsize.tracked: fake weights, no kernel runs, no data, under
PyTorch's MemTracker) and for real (plan/accuracy.step_peak, torch.cuda.max_memory_allocated).
Prints one row per setup.

The simulated side goes through the tier's own harness, not through plan/accuracy's build: that
build lets Accelerate place the model (``model.to(device)``), and torch moves a fake parameter by
swapping it for the moved one (``Module._apply``), which ``torch.utils.swap_tensors`` refuses
while the fake mode holds a weak reference to it: "_apply(): Couldn't swap Embedding.weight". The
harness keeps the fake weights where they are (Accelerate's device placement off), as the tier
does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "simgpu"))


@dataclass(frozen=True)
class Case:
    """A setup as fullsize.tracked reads one: the model's transformers config, the planner's
    candidate and the sequence length (fullsize.Setup names a published shape instead)."""

    shape: Any
    candidate: Any
    seq: int

    def config(self):
        return self.shape


def llama():
    """The tests/gpu/test_gpu_plan.py Llama case."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )


def simulated_peak(config, setup, seq: int) -> int:
    """The simulated tier's peak for one step of ``setup`` (after a warm one), bytes."""
    import fullsize

    return fullsize.tracked(Case(config, setup, seq))["peak"]


def main() -> int:
    import torch

    from onegpu.plan import accuracy
    from onegpu.plan.candidate import setup as candidate

    if not torch.cuda.is_available():
        print("simgpu_vs_real: no CUDA GPU; nothing to compare")
        return 0
    config = llama()
    print(f"{'setup':<28} {'simulated MiB':>14} {'real MiB':>10} {'sim/real':>9}")
    for ckpt in ("off", "full", "every-n"):
        setup = candidate(4, 1, precision="bf16", checkpointing=ckpt)
        sim = simulated_peak(config, setup, 1024)
        real = accuracy.step_peak(config, setup, 1024)["peak_bytes"]
        print(
            f"{'bf16, checkpointing ' + ckpt:<28} {sim / 2**20:>14.1f} {real / 2**20:>10.1f} "
            f"{sim / real:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
