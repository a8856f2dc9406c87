"""On a CUDA GPU: the simulated peak beside the real one, for the same setups.

    python scripts/simgpu_vs_real.py          # (scripts/gpu_check.sh runs it as the `simpeak` step)

For each setup (the tests/gpu/test_gpu_plan.py Llama case: hidden 512, 6 layers, 4 x 1024 tokens,
bf16 autocast; checkpointing off / full / every-n) plan/accuracy.step_peak runs twice: on fake
"cuda" tensors under PyTorch's MemTracker (what the simulated tier sees: no kernel runs, no data),
and for real, read from torch.cuda.max_memory_allocated. Prints one row per setup.
"""

from __future__ import annotations

import sys


def simulated_peak(config, setup, seq: int) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from onegpu.plan import accuracy

    tracker = MemTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        accuracy.step_peak(config, setup, seq, steps=1)
    peak = tracker.get_tracker_snapshot("peak")
    return max(
        v["Total"] for k, v in peak.items() if isinstance(k, torch.device) and k.type == "cuda"
    )


def main() -> int:
    import torch
    import transformers

    from onegpu.plan import accuracy
    from onegpu.plan.candidate import setup as candidate

    if not torch.cuda.is_available():
        print("simgpu_vs_real: no CUDA GPU; nothing to compare")
        return 0
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_cache=False,
    )
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
