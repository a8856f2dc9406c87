"""How many sequences of what length the KV cache can hold: the memory left after the weights (free
GPU memory on CUDA, available RAM with a cap on CPU), divided by what one sequence of ``max_len``
positions takes. Printed at start, so the operator sees why a server runs 3 sequences, not 8."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from onegpu.errors import ConfigError

GiB = 1024**3
CUDA_SHARE = 0.9  # of the free memory: the rest is for activations of the prefill and the sampler
CPU_SHARE = 0.5  # of the available RAM: the machine is shared with everything else running on it
CPU_CAP = 8 * GiB  # a CPU server with 200 GB free should not take 100 GB for a cache it cannot fill
DEFAULT_MAX_LEN = 4096  # a cache sized to a 131K context would take tens of GB (DESIGN.md §4)


@dataclass(frozen=True)
class KVPlan:
    bytes_per_position: int
    budget_bytes: int
    budget_source: str
    max_len: int
    max_slots: int
    fits: int  # sequences of max_len the budget holds

    def describe(self) -> str:
        per_seq = self.bytes_per_position * self.max_len
        return (
            f"KV cache: {self.bytes_per_position / 1024:.1f} KiB per position, "
            f"{per_seq / 2**20:.1f} MiB per {self.max_len}-token sequence; "
            f"budget {self.budget_bytes / 2**20:.0f} MiB ({self.budget_source}) holds {self.fits}; "
            f"serving {self.max_slots} at once "
            f"({self.max_slots * per_seq / 2**20:.1f} MiB)"
        )


def plan_kv(
    bytes_per_position: int,
    context: Optional[int],
    device: str,
    max_len: Optional[int] = None,
    max_slots: int = 8,
    kv_memory_gib: Optional[float] = None,
) -> KVPlan:
    """Sequence length and count for the cache. ``context``: the model's own limit (None when it
    has none); ``max_len``/``max_slots``: what the operator asked for, lowered to what fits."""
    if max_len is not None and context is not None and max_len > context:
        raise ConfigError(
            f"--max_len {max_len} is over the model's context of {context} tokens.",
            hint=f"use --max_len {context} or less",
        )
    length = max_len or min(context or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
    budget, source = memory_budget(device, kv_memory_gib)
    fits = budget // max(1, bytes_per_position * length)
    if fits < 1:
        most = budget // max(1, bytes_per_position)
        raise ConfigError(
            f"one sequence of --max_len {length} needs "
            f"{bytes_per_position * length / 2**20:.0f} MiB of KV cache; "
            f"the budget is {budget / 2**20:.0f} MiB ({source}).",
            hint=f"lower --max_len to {most} or less, or raise --kv_memory",
        )
    return KVPlan(bytes_per_position, budget, source, length, min(max_slots, fits), fits)


def memory_budget(device: str, kv_memory_gib: Optional[float]) -> tuple[int, str]:
    """Bytes the cache may take, and where the figure comes from."""
    cap = int(kv_memory_gib * GiB) if kv_memory_gib else None
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        budget, source = int(free * CUDA_SHARE), f"{CUDA_SHARE:.0%} of free GPU memory"
    else:
        available = available_ram()
        budget = min(int(available * CPU_SHARE), CPU_CAP)
        source = f"{CPU_SHARE:.0%} of available RAM, at most {CPU_CAP // GiB} GiB"
    if cap is not None and cap < budget:
        return cap, "--kv_memory"
    return budget, source


def available_ram() -> int:
    """MemAvailable (what can be had without swapping); the free pages where /proc is absent."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
