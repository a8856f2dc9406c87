"""`onegpu doctor`: what this machine can run fast, and what to install for what is missing.

Each fast path is checked by trying it where that is cheap (an SDPA kernel on a tiny tensor, a fused
optimizer step, loading bitsandbytes' native library), not by version numbers alone: a package that
is installed but cannot load its kernels is as good as missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    hint: str | None = None  # what to install or change when not ok


def _installed(dist: str) -> str | None:
    """The installed version of a distribution, or None (no import: some take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------- versions
def versions() -> dict:
    import torch

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": driver_version(),
    }
    for dist in ("transformers", "accelerate", "datasets"):
        out[dist] = _installed(dist)
    return out


def driver_version() -> str | None:
    """The NVIDIA driver: from nvidia-smi where present, else the CUDA driver API version torch
    sees."""
    import torch

    if shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if torch.cuda.is_available():
        v = torch._C._cuda_getDriverVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    return None


def gpu_info() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
    }


# ---------------------------------------------------------------------------------- checks
NEEDS_GPU = "needs an NVIDIA GPU and a CUDA build of torch (pip install torch, Linux CUDA wheel)"
NEEDS_AMPERE = "needs an Ampere or newer NVIDIA GPU (A100, A10, RTX 30xx/40xx, L4, H100)"


def check_precision() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [
            Check("bf16", False, "no CUDA GPU (bf16 is emulated and slow on CPU)", NEEDS_AMPERE),
            Check("tf32", False, "no CUDA GPU", NEEDS_AMPERE),
        ]
    major, minor = torch.cuda.get_device_capability(0)
    ampere = major >= 8
    return [
        Check(
            "bf16",
            torch.cuda.is_bf16_supported() and ampere,
            f"compute capability {major}.{minor}",
            None if ampere else NEEDS_AMPERE + "; use techniques.precision=fp16 here",
        ),
        Check(
            "tf32", ampere, f"compute capability {major}.{minor}", None if ampere else NEEDS_AMPERE
        ),
    ]


def check_sdpa() -> list[Check]:
    """Run each scaled_dot_product_attention backend on a tiny causal problem on this device."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype)
    out = []
    for name, backend in (
        ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa-mem-efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("sdpa-math", SDPBackend.MATH),
    ):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.append(Check(name, True, f"runs on {device}"))
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0].split(". ")[0][:100]
            out.append(
                Check(
                    name,
                    False,
                    f"not on {device} ({first})",
                    NEEDS_GPU
                    if device == "cpu"
                    else "needs a newer GPU or torch build: pip install -U torch",
                )
            )
    return out


def check_fused_adamw() -> Check:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = torch.nn.Parameter(torch.zeros(4, device=device))
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], fused=True).step()
        return Check("adamw-fused", True, f"fused kernel runs on {device}")
    except RuntimeError as exc:
        return Check("adamw-fused", False, str(exc).splitlines()[0][:120], "pip install -U torch")


def check_flash_attn() -> Check:
    v = _installed("flash-attn") or _installed("flash_attn")
    if v is None:
        return Check(
            "flash_attn",
            False,
            "not installed (PyTorch SDPA's flash backend is used instead)",
            "pip install flash-attn --no-build-isolation (CUDA GPU, Ampere+)",
        )
    try:
        importlib.import_module("flash_attn")
    except (
        Exception
    ) as exc:  # a broken/ABI-mismatched build raises anything from ImportError to OSError
        return Check(
            "flash_attn",
            False,
            f"{v} installed but does not load: {str(exc).splitlines()[0][:100]}",
            "reinstall it against this torch: pip install --force-reinstall flash-attn "
            "--no-build-isolation",
        )
    return Check("flash_attn", True, v)


def check_bitsandbytes() -> Check:
    v = _installed("bitsandbytes")
    if v is None:
        return Check(
            "bitsandbytes",
            False,
            "not installed (8-bit optimizers, 4/8-bit weights)",
            "pip install 'onegpu[bnb]'",
        )
    try:
        from bitsandbytes import cextension
    except Exception as exc:
        return Check(
            "bitsandbytes",
            False,
            f"{v} does not import: {str(exc).splitlines()[0][:100]}",
            "pip install --force-reinstall bitsandbytes",
        )
    lib = cextension.lib
    if type(lib).__name__.startswith("ErrorHandler"):
        return Check(
            "bitsandbytes",
            False,
            f"{v}: native {cextension.BNB_BACKEND} library failed to load",
            "python -m bitsandbytes shows why; usually a CUDA/torch version mismatch",
        )
    import torch

    if torch.cuda.is_available() and not getattr(lib, "compiled_with_cuda", False):
        return Check(
            "bitsandbytes",
            False,
            f"{v}: loaded its CPU library only, GPU kernels missing",
            "pip install --force-reinstall bitsandbytes (a CUDA-enabled wheel)",
        )
    return Check("bitsandbytes", True, f"{v}, {cextension.BNB_BACKEND} library loaded")


def check_package(name: str, dist: str, purpose: str, hint: str) -> Check:
    """Installed and importable: a package whose import fails is reported with why."""
    v = _installed(dist)
    if v is None:
        return Check(name, False, f"not installed ({purpose})", hint)
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
        return Check(
            name,
            False,
            f"{v} does not import: {str(exc).splitlines()[0][:100]}",
            f"pip install --force-reinstall {dist}",
        )
    return Check(name, True, f"{v} ({purpose})")


def check_triton() -> Check:
    import torch

    v = _installed("triton")
    if v:
        return Check("triton", True, f"{v} (torch.compile GPU kernels)")
    if torch.cuda.is_available():
        return Check(
            "triton",
            False,
            "not installed: torch.compile cannot generate GPU kernels",
            "pip install triton (it ships with the Linux CUDA wheels of torch)",
        )
    return Check(
        "triton",
        False,
        "not installed (only needed for torch.compile on a GPU; CPU uses C++)",
        "comes with the Linux CUDA wheels of torch; nothing to do on a CPU-only machine",
    )


def check_deepspeed() -> Check:
    v = _installed("deepspeed")
    if v is None:
        return Check(
            "deepspeed",
            False,
            "not installed (ZeRO CPU/NVMe offload)",
            "pip install 'onegpu[deepspeed]'",
        )
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as exc:
        return Check(
            "deepspeed",
            False,
            f"{v}: ops do not import: {str(exc).splitlines()[0][:100]}",
            "pip install --force-reinstall deepspeed",
        )
    compatible = CPUAdamBuilder().is_compatible(verbose=False)
    ninja = shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None
    if not compatible or not ninja:
        why = (
            "cpu_adam op is not compatible here"
            if not compatible
            else "ninja is missing, so ops cannot be JIT-built"
        )
        return Check(
            "deepspeed",
            False,
            f"{v}: {why}",
            "pip install ninja, and have a C++ compiler (g++) on PATH",
        )
    return Check("deepspeed", True, f"{v}, cpu_adam op buildable (offload)")


def collect() -> dict:
    checks = (
        check_precision()
        + check_sdpa()
        + [check_fused_adamw(), check_flash_attn(), check_bitsandbytes()]
    )
    checks += [
        check_package(
            "torchao",
            "torchao",
            "8/4-bit optimizers, int8 weights",
            "pip install 'onegpu[torchao]'",
        ),
        check_deepspeed(),
        check_triton(),
        check_package("peft", "peft", "LoRA / QLoRA adapters", "pip install 'onegpu[peft]'"),
    ]
    return {
        "versions": versions(),
        "gpu": gpu_info(),
        "checks": {c.name: asdict(c) for c in checks},
        "engine_policy": engine_policy(),
    }


def engine_policy() -> list[str]:
    """The decode engine's device policy rows on this machine's device: on or off, and why
    (infer/policy.py; --policy_off ROW[,ROW] switches one off)."""
    import torch

    from onegpu.infer.policy import summary

    return summary("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------ output
def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    v, gpu = report["versions"], report["gpu"]
    console.print(
        f"torch {v['torch']} (CUDA {v['cuda'] or '-'}, cuDNN {v['cudnn'] or '-'}), driver "
        f"{v['driver'] or '-'}, python {v['python']}, transformers {v['transformers']}"
    )
    console.print(
        f"GPU: {gpu['name']}, capability {gpu['capability']}, {gpu['memory_gib']} GiB"
        + (f" (x{gpu['count']})" if gpu["count"] > 1 else "")
        if gpu
        else "GPU: none (CPU only)"
    )
    table = Table(show_lines=False)
    for col in ("fast path", "", "found", "to get it"):
        table.add_column(col, overflow="fold")
    for c in report["checks"].values():
        table.add_row(
            c["name"], "[green]yes[/]" if c["ok"] else "[red]no[/]", c["detail"], c["hint"] or ""
        )
    console.print(table)
    console.print(
        "engine policy (off: --policy_off ROW[,ROW] of generate, serve, bench infer, grpo):"
    )
    for line in report["engine_policy"]:
        console.print(f"  {line}", markup=False, highlight=False)


def cli(argv: Sequence[str]) -> int:
    from onegpu.cli.args import make_parser, parse

    parser = make_parser(
        "onegpu doctor",
        "Show versions, the GPU, and which fast paths work here "
        "(with what to install for the missing ones).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    _, ns = parse(parser, argv)
    report = collect()
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0
