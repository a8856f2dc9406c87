"""What we run on: the present device and what its fast paths are."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeviceInfo:
    type: str  # "cuda", "mps" or "cpu"
    name: str
    total_memory: int  # bytes (host RAM for cpu)
    capability: tuple[int, int] | None = None  # CUDA compute capability

    @property
    def is_gpu(self) -> bool:
        return self.type in ("cuda", "mps")

    @property
    def bf16(self) -> bool:
        """bf16 math is native (Ampere+ CUDA). On CPU it works but is slow, so we never pick it there."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)


def detect() -> DeviceInfo:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo("cuda", props.name, props.total_memory, (props.major, props.minor))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return DeviceInfo("mps", "Apple MPS", _host_memory())
    return DeviceInfo("cpu", "CPU", _host_memory())


def _host_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil comes with accelerate; be safe anyway
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
