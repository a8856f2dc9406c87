"""What an export takes, said before it starts: memory for the merge and the check (the base in
float32, the export in its dtype, side by side) and disk for each format. An export that would not
fit is refused before anything is written."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from onegpu.errors import OnegpuError
from onegpu.export.config import UNQUANTIZED

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bits per weight of llama.cpp's types (its ggml type sizes: q8_0 34 bytes per 32 weights, q6_K 210
# per 256, q5_K 176 per 256, q4_K 144 per 256; the _m mixes keep some tensors a type higher)
GGUF_BITS = {
    "f32": 32,
    "f16": 16,
    "bf16": 16,
    "q8_0": 8.5,
    "q6_k": 6.5625,
    "q5_k_m": 5.5,
    "q4_k_m": 4.5,
}


class MemoryShortError(OnegpuError):
    """The machine's free memory is below what the export needs."""


@dataclass
class ExportPlan:
    params: int
    dtype: str  # what the export is written in
    memory_bytes: int
    disk_bytes: int
    disk_parts: dict[str, int] = field(default_factory=dict)  # format -> bytes
    formats: str = ""  # as --format takes them
    quant: str = ""  # the GGUF type ("" without a GGUF format)

    def needs(self) -> str:
        """What it takes, in words (the export's pre-flight line and `onegpu plan`'s)."""
        parts = ", ".join(f"{name} {_mib(n)}" for name, n in self.disk_parts.items())
        return (
            f"about {_mib(self.memory_bytes)} of memory (the base in float32, also for a QLoRA "
            f"run, beside the export in {self.dtype}) and {_mib(self.disk_bytes)} of disk ({parts})"
        )

    def message(self, available: int, free_disk: int) -> str:
        return (
            f"export plan: {self.params / 1e6:,.1f}M parameters; needs {self.needs()}; free: "
            f"{_mib(available)} of memory, {_mib(free_disk)} of disk"
        )


def count_params(model_dir: str) -> int:
    """Parameters stored in the folder's safetensors files (headers only, nothing loaded)."""
    from safetensors import safe_open

    total = 0
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(shard), "np") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def make_plan(params: int, dtype: str, formats: list[str], quant: str) -> ExportPlan:
    out = BYTES.get(dtype, 4)
    gguf = int(params * GGUF_BITS.get(quant, 16) / 8)
    # the merge holds the float32 base while it is cast to the export's dtype; the check holds the
    # float32 source beside one export at a time (transformers' copy, or llama.cpp's in its child)
    beside = max(out, gguf / max(params, 1) if {"gguf", "ollama"} & set(formats) else 0)
    memory = int(params * (4 + beside)) + 256 * 2**20
    parts = {}
    if "safetensors" in formats:
        parts["safetensors"] = params * out
    if {"gguf", "ollama"} & set(formats):
        # the converter reads a merged folder (the safetensors one, else a temporary one) and,
        # for a quantized type, writes an f16 GGUF the quantizer reads before it is removed
        merged = 0 if "safetensors" in formats else params * out
        f16 = 0 if quant in UNQUANTIZED else params * 2
        copies = 2 if {"gguf", "ollama"} <= set(formats) else 1  # a hard link where it can be
        parts[f"gguf {quant}"] = merged + f16 + gguf * copies
    gguf_quant = quant if {"gguf", "ollama"} & set(formats) else ""
    return ExportPlan(
        params, dtype, memory, sum(parts.values()), parts, ",".join(formats), gguf_quant
    )


def check_memory(plan: ExportPlan, available: int) -> None:
    if plan.memory_bytes > available:
        raise MemoryShortError(
            f"the export needs about {_mib(plan.memory_bytes)} of memory (the base in float32 "
            f"beside the export), and {_mib(available)} is free.",
            hint="close other programs, or export on a machine with more memory",
        )


def available_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # Linux without psutil
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
