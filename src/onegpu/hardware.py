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
        """bf16 math is native (Ampere+ CUDA). On CPU it works but is slow, so we never pick it
        there."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer; the catalog's cards with an fp8
        peak are exactly these."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 9)


def detect() -> DeviceInfo:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo("cuda", props.name, props.total_memory, (props.major, props.minor))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return DeviceInfo("mps", "Apple MPS", _host_memory())
    return DeviceInfo("cpu", "CPU", _host_memory())


def _host_memory() -> int:
    return _ram("total")


def host_memory_available() -> int:
    """Bytes of RAM free for a new allocation now (the OS's estimate)."""
    return _ram("available")


def _ram(which: str) -> int:
    try:
        import psutil

        return int(getattr(psutil.virtual_memory(), which))
    except ImportError:  # psutil comes with accelerate; be safe anyway
        import os

        pages = "SC_PHYS_PAGES" if which == "total" else "SC_AVPHYS_PAGES"
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)


# --- GPU catalog ---------------------------------------------------------------------------------
# Peak *dense* tensor throughput (no 2:4 sparsity) in TFLOP/s, memory bandwidth in GB/s. Figures
# are from the vendors' product datasheets / architecture whitepapers (NVIDIA); where a card has no
# public datasheet (A10G) the figures are the cloud vendor's published ones. memory_gib is what the
# driver reports as total memory (a little less than the marketing "GB").
@dataclass(frozen=True)
class GpuSpec:
    key: str  # short catalog name used by --gpu
    name: str
    memory_gib: float
    fp32: float  # TFLOP/s, CUDA cores
    tf32: float  # TFLOP/s, tensor cores (0 = no TF32)
    bf16: float  # TFLOP/s, fp16/bf16 tensor cores with fp32 accumulation
    fp8: float  # TFLOP/s (0 = no FP8 tensor cores)
    bandwidth_gbs: float
    capability: tuple[int, int]
    has_bf16: bool
    tc_multiple: int = 8  # fp16/bf16 tensor cores want dimensions that are multiples of 8
    aliases: tuple[str, ...] = ()

    def peak_tflops(self, precision: str, tf32: bool = True) -> float:
        """Peak matmul throughput for a compute precision name (fp32, fp16, bf16, bf16-pure,
        fp8)."""
        if precision in ("fp16", "bf16", "bf16-pure"):
            return self.bf16
        if precision == "fp8":
            return self.fp8 or self.bf16
        return self.tf32 if (tf32 and self.tf32) else self.fp32


# A table, one card per entry: kept in rows rather than one argument per line.
# fmt: off
CATALOG: tuple[GpuSpec, ...] = (
    # Turing / Volta: no bf16, no tf32 (V100: NVIDIA V100 datasheet, SXM2; T4: T4 datasheet)
    GpuSpec("T4", "NVIDIA Tesla T4", 14.6, 8.1, 0, 65, 0, 320, (7, 5), False,
            aliases=("tesla t4",)),
    GpuSpec("V100", "NVIDIA Tesla V100 SXM2 32GB", 31.7, 15.7, 0, 125, 0, 900, (7, 0), False,
            aliases=("v100-sxm2", "v100 32gb", "tesla v100")),
    GpuSpec("V100-16GB", "NVIDIA Tesla V100 16GB", 15.8, 15.7, 0, 125, 0, 900, (7, 0), False,
            aliases=("v100 16gb", "v100-sxm2-16gb")),
    # Ampere (A100 datasheet; A10G: AWS G5 figures; RTX 3090: GA102 whitepaper, fp32-accumulate)
    GpuSpec("A10G", "NVIDIA A10G", 22.0, 31.2, 35, 70, 0, 600, (8, 6), True, aliases=("a10g",)),
    GpuSpec("A10", "NVIDIA A10", 22.0, 31.2, 62.5, 125, 0, 600, (8, 6), True),
    GpuSpec("RTX3090", "NVIDIA GeForce RTX 3090", 23.6, 35.6, 35.6, 71, 0, 936, (8, 6), True,
            aliases=("rtx 3090", "geforce rtx 3090", "3090")),
    GpuSpec("A100-40GB", "NVIDIA A100 40GB SXM", 39.4, 19.5, 156, 312, 0, 1555, (8, 0), True,
            aliases=("a100-sxm4-40gb", "a100 40gb", "a100-pcie-40gb")),
    GpuSpec("A100-80GB", "NVIDIA A100 80GB SXM", 79.2, 19.5, 156, 312, 0, 2039, (8, 0), True,
            aliases=("a100", "a100-sxm4-80gb", "a100 80gb", "a100 80gb pcie")),
    GpuSpec("A6000", "NVIDIA RTX A6000", 47.5, 38.7, 77.4, 154.8, 0, 768, (8, 6), True,
            aliases=("rtx a6000",)),
    # Ada (L4, L40S datasheets; RTX 4090: Ada whitepaper, fp32-accumulate)
    GpuSpec("L4", "NVIDIA L4", 22.0, 30.3, 60, 121, 242.5, 300, (8, 9), True),
    GpuSpec("L40S", "NVIDIA L40S", 44.5, 91.6, 183, 362, 733, 864, (8, 9), True),
    GpuSpec("RTX4090", "NVIDIA GeForce RTX 4090", 23.5, 82.6, 82.6, 165.2, 330.3, 1008, (8, 9),
            True,
            aliases=("rtx 4090", "geforce rtx 4090", "4090")),
    # Hopper (H100 / H200 datasheets)
    GpuSpec("H100", "NVIDIA H100 SXM 80GB", 79.1, 67, 494.7, 989.4, 1978.9, 3350, (9, 0), True,
            aliases=("h100 sxm", "h100-sxm", "h100 80gb hbm3", "h100 sxm5")),
    GpuSpec("H100-PCIe", "NVIDIA H100 PCIe 80GB", 79.1, 51, 378, 756, 1513, 2000, (9, 0), True,
            aliases=("h100 pcie", "h100-pcie")),
    GpuSpec("H100-NVL", "NVIDIA H100 NVL 94GB", 93.1, 60, 417.5, 835.5, 1670.5, 3900, (9, 0), True,
            aliases=("h100 nvl",)),
    GpuSpec("H200", "NVIDIA H200 SXM 141GB", 139.8, 67, 494.7, 989.4, 1978.9, 4800, (9, 0), True,
            aliases=("h200 sxm", "h200-sxm")),
    # Blackwell (HGX B200 datasheet, per GPU)
    GpuSpec("B200", "NVIDIA B200 180GB", 178.4, 75, 1100, 2250, 4500, 8000, (10, 0), True),
)
# fmt: on


def _norm(name: str) -> str:
    out = name.lower().replace("nvidia", "").replace("_", " ").replace("-", " ")
    return " ".join(out.split())


def find_gpu(name: str) -> GpuSpec:
    """Catalog entry for a user-given name ("h100", "A100-40GB", "rtx 4090"); did-you-mean
    otherwise."""
    import difflib

    from onegpu.errors import ConfigError

    want = _norm(name)
    table = {_norm(g.key): g for g in CATALOG}
    for g in CATALOG:
        table.update({_norm(a): g for a in g.aliases})
        table.setdefault(_norm(g.name), g)
    if want in table:
        return table[want]
    partial = {
        g.key: g for k, g in table.items() if want and want in k.split() + [k.replace(" ", "")]
    }
    if len(partial) == 1:
        return next(iter(partial.values()))
    close = difflib.get_close_matches(want, list(table), n=1, cutoff=0.5)
    hint = (
        f"did you mean '{table[close[0]].key}'?"
        if close
        else f"known GPUs: {', '.join(g.key for g in CATALOG)}"
    )
    raise ConfigError(f"unknown GPU '{name}'.", hint=hint)


def match_device(device: DeviceInfo) -> GpuSpec | None:
    """The catalog entry for a detected CUDA device (by name, then by memory size), or None."""
    if device.type != "cuda":
        return None
    name = _norm(device.name)
    squashed = name.replace(" ", "")
    scored = []
    for g in CATALOG:
        keys = [_norm(k) for k in (g.key, *g.aliases)]
        matched = [len(k) for k in keys if k in name or k.replace(" ", "") in squashed]
        if matched:
            scored.append((max(matched), g))
    if not scored:
        return None
    # The most specific name wins ("h100 pcie" over "h100"); memory size separates 40/80 GB cards.
    mem_gib = device.total_memory / 2**30
    return min(
        scored,
        key=lambda sg: (
            -sg[0] if abs(sg[1].memory_gib - mem_gib) < 4 else 0,
            abs(sg[1].memory_gib - mem_gib),
        ),
    )[1]


def spec_from_device(device: DeviceInfo) -> GpuSpec:
    """A GpuSpec for what we run on: the catalog entry, or the measured CPU."""
    if device.type == "cuda":
        spec = match_device(device)
        if spec is not None:
            return spec
        from onegpu.errors import UnavailableError

        raise UnavailableError(
            f"'{device.name}' is not in the GPU catalog, so its peak speed is unknown.",
            hint="plan for the closest catalog card with --gpu NAME (onegpu plan --gpu list)",
        )
    return cpu_spec(device)


def cpu_spec(device: DeviceInfo | None = None) -> GpuSpec:
    """The CPU as a 'GPU': measured fp32 matmul TFLOP/s and copy bandwidth, cached per CPU model."""
    device = device or DeviceInfo("cpu", "CPU", _host_memory())
    m = measure_cpu()
    return GpuSpec(
        "CPU",
        f"CPU ({m['model']}, {m['threads']} threads)",
        device.total_memory / 2**30,
        m["tflops"],
        0,
        m["tflops"],
        0,
        m["bandwidth_gbs"],
        (0, 0),
        False,
        tc_multiple=1,
    )


def measure_cpu(force: bool = False) -> dict:
    """fp32 matmul throughput and memory bandwidth of this CPU (cached: ~1 s the first time)."""
    import json
    import platform

    import torch

    from onegpu.paths import cache_dir

    threads = torch.get_num_threads()
    model = _cpu_model() or platform.processor() or "unknown"
    path = cache_dir() / "hardware" / f"cpu-{_slug(model)}-{threads}t.json"
    if path.is_file() and not force:
        return json.loads(path.read_text())
    result = {
        "model": model,
        "threads": threads,
        "tflops": measure_matmul_flops("cpu") / 1e12,
        "bandwidth_gbs": _copy_gbs(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def measure_matmul_flops(device_type: str = "cpu", seconds: float = 0.4) -> float:
    """Best dense-matmul FLOP/s seen over ``seconds``: fp32 on a CPU, bf16 on a CUDA GPU. The one
    measured peak: the CPU's planner spec and the denominator of the benchmarks' MFU."""
    import time

    import torch

    on_gpu = device_type == "cuda"
    n, dtype = (8192, torch.bfloat16) if on_gpu else (1024, torch.float32)
    a, b = (torch.randn(n, n, dtype=dtype, device=device_type) for _ in range(2))
    a @ b  # warm-up: the first call picks kernels and touches pages
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if on_gpu:
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def _copy_gbs(mbytes: int = 64) -> float:
    import time

    import torch

    src = torch.ones(mbytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9  # read + write


READ_MIB, READ_REPS = 256, 5
READ_METHOD = (
    f"torch.sum over a {READ_MIB} MiB fp32 tensor (every byte read once), best of {READ_REPS}"
)


def measure_read_gbs(device_type: str = "cpu", mib: int = READ_MIB, reps: int = READ_REPS) -> float:
    """Memory read bandwidth in GB/s, measured: the best of ``reps`` sums of a tensor far larger
    than any cache (READ_METHOD). What a decode step does with its weights and KV cache is read
    them once, so this, not a copy, is its limit where no datasheet figure exists (CPUs)."""
    import time

    import torch

    x = torch.ones(mib * 2**20 // 4, device=device_type)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    x.sum()  # warm-up: touches the pages, picks the kernel
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def memory_bandwidth(device: DeviceInfo) -> tuple[float, str]:
    """The memory bandwidth (GB/s) bounding a decode step on ``device``, and where it comes from:
    a catalog card's datasheet figure, else measured here (measure_read_gbs)."""
    spec = match_device(device)
    if spec is not None:
        return spec.bandwidth_gbs, f"GPU catalog: {spec.name} datasheet"
    return measure_read_gbs(device.type), READ_METHOD


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]
