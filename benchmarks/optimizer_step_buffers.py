"""What torchao's compiled optimizer steps allocate on a GPU: the Triton code inductor generates for
one 8-bit and one 4-bit AdamW step of a 1M-value bf16 weight on a simulated H100 (sm90), and the
full-size buffers its wrapper allocates beyond the step's inputs, in bytes per weight value
(``plan.memory.STEP_TEMP_PER_ELEMENT``'s GPU figures; the CPU figures are measured in
tests/test_plan_memory.py).

No GPU: the step is traced on fake "cuda" tensors (tests/simgpu/cards.py's shim and card) and
inductor generates its Triton kernels and wrapper for sm90 without running them (loading them
needs the CUDA driver, which is where this stops). So what it shows is the generated code's
allocations, not a measured peak; autotuning's copies of mutated arguments at a kernel's first call
are left out (torch 2.13's inductor keeps those within the memory already freed by the step).
Needs triton beside torch in the interpreter it runs with (the project's environment has none):

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.13.0 triton==3.8.0
    PYTHONPATH=src /tmp/tv/bin/python benchmarks/optimizer_step_buffers.py

The step mirrors torchao 0.18's ``single_param_adam`` with its OptimState8bit / OptimState4bit
state unrolled into codes, scales and the quantization map (their ``dequantize`` and ``copy_``),
so that it traces as plain tensors. Writes results/optimizer-step-buffers.md.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "simgpu"))
OUT = ROOT / "benchmarks" / "results" / "optimizer-step-buffers.md"
N = 256 * 4096  # values in the weight
BITS = {"adamw-8bit-ao": 8, "adamw-4bit-ao": 4}


def step_fn(bits: int):
    import torch
    from torchao.optim.quant_utils import (
        dequant_with_qmap,
        quantize_4bit_with_qmap,
        quantize_8bit_with_qmap,
        scale_tensor,
    )

    block = 128 if bits == 4 else 256  # torchao's defaults

    def dequantize(codes, qmap, scale, n):
        if bits == 4:  # two codes a byte
            codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1)
        return dequant_with_qmap(codes, qmap, scale).view(n)

    def quantize(x, qmap):
        if bits == 4:
            codes = quantize_4bit_with_qmap(x, qmap)
            return (codes[::2] << 4) | codes[1::2]
        return quantize_8bit_with_qmap(x, qmap)

    def step(p, grad, c1, s1, c2, s2, q1, q2, lr, t):
        beta1, beta2, wd, eps = 0.9, 0.999, 0.01, 1e-8
        p32, g32 = p.float(), grad.float()
        p32 = p32 - lr * wd * p32
        m = dequantize(c1, q1, s1, p.numel()).lerp(g32, 1 - beta1)
        v = dequantize(c2, q2, s2, p.numel()).lerp(g32.square(), 1 - beta2)
        for state, (codes, scale, qmap) in ((m, (c1, s1, q1)), (v, (c2, s2, q2))):
            scaled, new_scale = scale_tensor(state, block)
            codes.copy_(quantize(scaled.view(-1), qmap))
            scale.copy_(new_scale)
        denom = v.sqrt() / (1 - beta2**t).sqrt() + eps
        p.copy_(p32 - lr * (m / (1 - beta1**t)) / denom)

    def inputs():
        cuda = "cuda"
        codes = N // 2 if bits == 4 else N
        return [
            torch.empty(N, dtype=torch.bfloat16, device=cuda),
            torch.empty(N, dtype=torch.bfloat16, device=cuda),
            torch.empty(codes, dtype=torch.uint8, device=cuda),
            torch.empty(N // block, device=cuda),
            torch.empty(codes, dtype=torch.uint8, device=cuda),
            torch.empty(N // block, device=cuda),
            torch.empty(2**bits, device=cuda),
            torch.empty(2**bits, device=cuda),
            torch.empty((), device=cuda),
            torch.empty(()),
        ]

    return step, inputs


def generated_code(bits: int) -> str:
    """Inductor's wrapper and kernels for the step on the simulated card, as text."""
    import cards
    import torch

    cards.install(cards.CARDS["H100"])  # before inductor's modules take torch.cuda's functions
    import torch._inductor.config as icfg
    import torch._inductor.fx_passes.joint_graph as joint
    import torch.utils._triton as tu
    from torch._inductor import codecache
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    # What cards.install leaves to a real build, for inductor's passes: the device index, its RNG
    # state, the target Triton compiles for (sm90; asking the driver for it fails here).
    torch._C._cuda_getDevice = lambda: 0
    torch.cuda._exchange_device = torch.cuda._maybe_exchange_device = lambda device: 0
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    backend = make_backend(GPUTarget("cuda", 90, 32))
    tu.triton_backend = lambda: backend
    tu.triton_hash_with_backend = lambda: "0" * 64
    # Passes that run real ops on example tensors (pattern registration, constant folding of
    # uniform values): none of them applies to this graph.
    icfg.pattern_matcher = False
    joint.lazy_init = lambda *args, **kwargs: None
    joint.constant_fold_uniform_value = lambda gm: None

    code = []
    load = codecache.PyCodeCache.load_by_key_path

    def keep(key, path, *args, **kwargs):  # the generated module's text, before it is loaded
        code.append(Path(path).read_text())
        return load(key, path, *args, **kwargs)

    codecache.PyCodeCache.load_by_key_path = keep
    step, inputs = step_fn(bits)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = inputs()
        graph = make_fx(step, tracing_mode="fake")(*args)
        try:
            compile_fx(graph, args)
        except Exception:  # loading the kernels needs the CUDA driver; the text is what we want
            if not code:
                raise
    del mode
    return next(c for c in code if "def call(" in c)  # the wrapper (kernels load as modules too)


def buffers(code: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each empty_strided_cuda in the wrapper's call()."""
    call = code[code.index("def call(") :]
    found = re.findall(r"empty_strided_cuda\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", call)
    return [(tuple(int(d) for d in shape.split(",") if d.strip()), dt) for shape, dt in found]


def child(bits: int) -> None:
    import torch

    code = generated_code(bits)
    kernels = len(re.findall(r"\.run\(", code[code.index("def call(") :]))
    found = buffers(code)
    total = sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in found)
    names = " ".join(f"{dtype}{list(shape)}" for shape, dtype in found) or "-"
    print(f"RESULT {bits} {kernels} {total / N:.4f} {names}", flush=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        return 0
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("needs triton beside torch: see this script's docstring", file=sys.stderr)
        return 2
    import cards
    import torch

    shim, why = cards.build_shim(Path.home() / ".cache" / "onegpu-simgpu")
    if shim is None:
        print(why, file=sys.stderr)
        return 2
    env = dict(
        os.environ,
        LD_PRELOAD=str(shim),
        **{cards.ENV_CARD: "H100"},
        TORCHINDUCTOR_COMPILE_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=str(Path("/tmp") / "onegpu-step-buffers"),
    )
    lines = [
        "Generated code of torchao's AdamW step on a simulated H100 (sm90), one bf16 weight of "
        f"{N:,} values: full-size buffers the wrapper allocates beyond the inputs.",
        "",
        "| optimizer | kernels | buffers | bytes per weight value |",
        "|---|--:|---|--:|",
    ]
    for name, bits in BITS.items():
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(bits)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        if not found:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        _, _, kernels, per, bufs = found[0].split(" ", 4)
        lines.append(f"| {name} | {kernels} | {bufs} | {float(per):.2f} |")
        print(lines[-1], flush=True)
    import triton

    lines += [
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, "
        "command: `PYTHONPATH=src python benchmarks/optimizer_step_buffers.py` "
        "(a Python with triton)",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
