"""How large the engine's KV pool is when sized from memory (``EngineConfig.kv_budget``, what
`onegpu serve` asks for): the memory left after the weights (free GPU memory on CUDA, available
RAM with a cap on CPU), in blocks of ``block_size`` positions. Sequences take blocks as
they grow, so the pool holds as many sequences as their real lengths allow; ``max_len`` bounds one
sequence, and the pool must hold at least one of it. Printed at start, so the operator sees what
the budget holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from onegpu.errors import ConfigError

GiB = 1024**3
CUDA_SHARE = 0.9  # of the free memory: the rest is for activations of the prefill and the sampler
CPU_SHARE = 0.5  # of the available RAM: the machine is shared with everything else running on it
CPU_CAP = 8 * GiB  # a CPU server with 200 GB free should not take 100 GB for a cache it cannot fill
DEFAULT_MAX_LEN = 4096  # the longest sequence by default; the pool is shared, not sized by it
BLOCK_SIZE = 16  # positions a block: vLLM's default, the unit of allocation and of prefix sharing


@dataclass(frozen=True)
class KVPlan:
    bytes_per_position: int
    budget_bytes: int
    budget_source: str
    max_len: int
    max_slots: int  # sequences decoded together at most
    block_size: int
    num_blocks: int  # in the pool, the reserved null block included
    fits: int  # sequences of max_len the pool holds at worst

    def describe(self) -> str:
        positions = (self.num_blocks - 1) * self.block_size
        return (
            f"KV cache: {self.bytes_per_position / 1024:.1f} KiB per position; "
            f"budget {self.budget_bytes / 2**20:.0f} MiB ({self.budget_source}) holds "
            f"{self.num_blocks - 1} blocks of {self.block_size} positions ({positions} positions: "
            f"{self.fits} sequences of {self.max_len} at worst, more at their real lengths); "
            f"decoding up to {self.max_slots} at once"
        )


def plan_kv(
    bytes_per_position: int,
    context: Optional[int],
    device: str,
    max_len: Optional[int] = None,
    max_slots: int = 64,
    kv_memory_gib: Optional[float] = None,
    block_size: int = BLOCK_SIZE,
) -> KVPlan:
    """The pool for the budget. ``context``: the model's own limit (None when it has none);
    ``max_len``/``max_slots``: what the operator asked for."""
    if max_len is not None and context is not None and max_len > context:
        raise ConfigError(
            f"--max_len {max_len} is over the model's context of {context} tokens.",
            hint=f"use --max_len {context} or less",
        )
    length = max_len or min(context or DEFAULT_MAX_LEN, DEFAULT_MAX_LEN)
    budget, source = memory_budget(device, kv_memory_gib)
    blocks = budget // max(1, bytes_per_position * block_size)
    per_seq = -(-length // block_size)
    if blocks < per_seq + 1:  # and the null block
        most = (blocks - 1) * block_size
        raise ConfigError(
            f"one sequence of --max_len {length} needs "
            f"{bytes_per_position * (per_seq + 1) * block_size / 2**20:.0f} MiB of KV cache; "
            f"the budget is {budget / 2**20:.0f} MiB ({source}).",
            hint=f"lower --max_len to {max(most, 0)} or less, or raise --kv_memory",
        )
    fits = (blocks - 1) // per_seq
    return KVPlan(bytes_per_position, budget, source, length, max_slots, block_size, blocks, fits)


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
