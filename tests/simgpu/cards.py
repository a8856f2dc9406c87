"""The simulated GPU: the one place that makes a card, for the `simgpu` test tier.

A card runs in its own Python process (``run_card``): the native shim (``shim.cpp``, built here with
the machine's C++ compiler against the installed torch's headers) must be loaded with LD_PRELOAD
before torch is imported, because torch reads its CUDA hooks once, at import. In that process
``install(card)`` makes the card visible to everything that asks torch about CUDA, and tensors on
"cuda" are FakeTensors (``fake_cuda``): shapes, dtypes, strides and devices without data.

What the simulation substitutes (everything else is the real code of torch, transformers,
Accelerate, PEFT and onegpu):
- the CUDA device itself: shim.cpp registers a device guard whose streams, events and
  synchronisations do nothing, and CUDA hooks saying "built with CUDA, one device";
- torch.cuda's queries: ``is_available``, ``device_count``, ``current_device``, ``set_device``,
  ``get_device_properties`` (name as the driver reports it, total memory, capability, SM count, L2),
  ``get_device_capability``, ``get_device_name``, ``is_bf16_supported``, ``synchronize``,
  ``mem_get_info``, ``_lazy_init``, ``is_initialized``, ``get_rng_state_all``/``manual_seed``, and
  the driver API version (``torch._C._cuda_getDriverVersion``, ``DRIVER_API``) and the current
  stream's handle (``torch._C._cuda_getCurrentRawStream``, 0: bitsandbytes reads it on import);
- torch.cuda's memory statistics (``memory_allocated``, ``max_memory_allocated``,
  ``reset_peak_memory_stats``, ``memory_reserved``, ``empty_cache``): the bytes of the live
  storages of fake "cuda" tensors, counted by a dispatch mode (``CudaMemory``), peak included;
  no allocator rounding, no CUDA context; with ``MEMORY.limit`` set (a check's switch) an op past
  it raises torch.OutOfMemoryError with the message a card gives ("CUDA out of memory. Tried to
  allocate ...");
- transformers under fake tensors: ``is_torchdynamo_compiling``-style "tracing" checks count
  FakeTensors as tracing, so the causal mask is always materialised (SDPA gets a bool mask);
  batches are built on the CPU and moved (``torch.tensor(..., device="cuda")`` would allocate);
- the host keeps real values: an op whose tensors are all real host tensors, and that names no
  "cuda" device, runs for real outside the fake mode (``_card_mode``);
- values: a fake tensor holds none, so wherever a test or the loop reads one (``.item()``,
  ``bool()``, ``float()``: the NaN guard's verdict, a logged loss, GradScaler's inf check) the
  answer is ``VALUE`` (finite), or what a test asks for with ``fake_value`` (``inf``: a skipped
  step); a ``bool()`` read answers whether that value is finite (the NaN guard asks
  ``isfinite``); ``torch.allclose`` on card tensors answers True (the fused loss's one-time
  check that its head reproduces the model's logits; the CPU tier checks it with values);
- the fake mode remembers the fake tensors it made from real ones strongly, not weakly, so
  ``module.to()`` can swap fake parameters in place; an op's output is not remembered at all, and
  an op given a storage (``Tensor.set_``) skips the fake mode's op cache, whose key would hold
  it: either would keep card bytes alive that a real card frees;
- placement: a test puts the model on the card itself (``on_card``) before its optimizer is built
  and turns Accelerate's device placement off; moving fake parameters swaps their tensors, which
  drops hooks registered on them (optimizer in backward), where a real ``.to()`` keeps them;
- threads: the backward runs on the calling thread (``torch.autograd.set_multithreading_enabled``
  off), not on autograd's CUDA device thread, so that coverage sees what runs in it (saved-tensor
  unpack hooks, the optimizer step in backward); nothing in a step depends on which thread;
- page-locked host buffers (``pin_memory=True``, activation offload) are fake host tensors: the
  CUDA host allocator is not there;
- streams and events (``torch.cuda.Stream``, ``Event``, ``current_stream``, ``default_stream``,
  ``stream``, ``set_stream``, ``Tensor.record_stream``): ``NoStream`` and ``NoEvent``, which order
  nothing. On a card with no
  data every copy is complete when its call returns, so work placed on a side stream (activation
  offload's copies) runs, and its bookkeeping (which storages stay, which come back, the in-flight
  bound) is checked, but the overlap itself and the waits that make it safe cannot be observed:
  a missing ``wait_stream``/``wait_event`` would go unnoticed here. That is tests/gpu's (skipped
  here) overlap test;
- checkpoint writing, text generation and the CUDA RNG state stay out of the tier: they need real
  values or the real driver.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV_CARD = "ONEGPU_SIMGPU_CARD"
DRIVER_API = 12080  # what the driver API reports (CUDA 12.8), for `onegpu doctor`
VALUE = 0.0  # what .item() of a fake tensor reads: finite (the NaN guard passes), no inf found


@dataclass(frozen=True)
class Card:
    """A GPU as torch.cuda reports it on a real machine with that card."""

    key: str
    name: str  # torch.cuda.get_device_name(), as the driver reports it
    capability: tuple[int, int]
    total_memory: int  # bytes, get_device_properties().total_memory
    sm_count: int  # multi_processor_count
    l2_bytes: int  # L2_cache_size

    @property
    def bf16(self) -> bool:
        """torch.cuda.is_bf16_supported() on this card: native from Ampere (8.0); emulated
        before."""
        return self.capability >= (8, 0)


# Total memory is what the driver leaves visible (nvidia-smi's MiB x 2**20).
CARDS = {
    "H100": Card("H100", "NVIDIA H100 80GB HBM3", (9, 0), 81559 * 2**20, 132, 50 * 2**20),
    "RTX4090": Card("RTX4090", "NVIDIA GeForce RTX 4090", (8, 9), 24564 * 2**20, 128, 72 * 2**20),
    "A100": Card("A100", "NVIDIA A100-SXM4-80GB", (8, 0), 81154 * 2**20, 108, 40 * 2**20),
    "T4": Card("T4", "Tesla T4", (7, 5), 15102 * 2**20, 40, 4 * 2**20),
}


# ----------------------------------------------------------------------------- the native shim
def torch_dir() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("torch").origin).parent


def build_shim(cache: Path) -> tuple[Path | None, str]:
    """(the shim's .so, "") or (None, why it cannot be built here). Rebuilt when the source or the
    torch version changes; ~3 s with g++."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return (
            None,
            "no C++ compiler (g++ or c++, or $CXX) to build tests/simgpu/shim.cpp",
        )
    tdir = torch_dir()
    if not (tdir / "include" / "ATen" / "detail" / "CUDAHooksInterface.h").is_file():
        return None, f"the installed torch ({tdir}) ships no C++ headers"
    src = HERE / "shim.cpp"
    key = hashlib.sha256(src.read_bytes() + str(tdir).encode()).hexdigest()[:16]
    out = cache / f"simgpu-shim-{key}.so"
    if out.is_file():
        return out, ""
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    lib = tdir / "lib"
    cmd = [
        compiler,
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        "-w",
        f"-I{tdir / 'include'}",
        str(src),
        "-o",
        str(tmp),
        f"-L{lib}",
        "-Wl,--no-as-needed",
        f"-Wl,-rpath,{lib}",
        "-lc10",
        "-ltorch_cpu",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        # C++20 is what newer torch headers need; try it before giving up.
        done = subprocess.run(
            [c.replace("c++17", "c++20") for c in cmd],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode:
        return None, f"building shim.cpp failed: {done.stderr.strip()[-400:]}"
    tmp.replace(out)
    return out, ""


def run_card(card: str, shim: Path, paths: list[str], timeout: int = 600):
    """Run pytest on ``paths`` in a fresh process that sees ``card``; returns the
    CompletedProcess."""
    env = dict(os.environ, LD_PRELOAD=str(shim), **{ENV_CARD: card})
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CUDA accelerator would load the real CUDA runtime
    # the card's checks need no installed pytest plugin; loading them all (hypothesis, faker,
    # langsmith ...) cost more CPU than the checks of a fast card
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "--no-header",
        "-rfE",
        "-o",
        "python_files=card_*.py",
        *paths,
    ]
    return subprocess.run(
        cmd,
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=HERE.parent.parent,
    )


# -------------------------------------------------------------------- inside a card's process
class Props:
    """What torch.cuda.get_device_properties returns, for a simulated card."""

    def __init__(self, card: Card):
        self.name = card.name
        self.total_memory = card.total_memory
        self.major, self.minor = card.capability
        self.multi_processor_count = card.sm_count
        self.L2_cache_size = card.l2_bytes
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.gcnArchName = ""
        self.uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', total_memory={self.total_memory >> 20}MB)"
        )


def current() -> Card:
    return CARDS[os.environ[ENV_CARD]]


def install(card: Card) -> None:
    """Make torch.cuda report ``card`` (see the module docstring for every substitution)."""
    import torch

    mem = MEMORY
    cuda = torch.cuda
    fixed = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_properties": lambda device=None: Props(card),
        "get_device_capability": lambda device=None: card.capability,
        "get_device_name": lambda device=None: card.name,
        "is_bf16_supported": lambda including_emulation=True: card.bf16 or including_emulation,
        "synchronize": lambda device=None: None,
        "mem_get_info": lambda device=None: (
            card.total_memory - mem.allocated(),
            card.total_memory,
        ),
        "_lazy_init": lambda: None,
        "is_initialized": lambda: True,
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)],
        "set_rng_state_all": lambda states: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "memory_allocated": lambda device=None: mem.allocated(),
        "max_memory_allocated": lambda device=None: mem.peak,
        "memory_reserved": lambda device=None: mem.allocated(),
        "max_memory_reserved": lambda device=None: mem.peak,
        "reset_peak_memory_stats": lambda device=None: mem.reset_peak(),
        "empty_cache": lambda: None,
    }
    for name, fn in fixed.items():
        setattr(cuda, name, fn)
        if hasattr(cuda.memory, name):
            setattr(cuda.memory, name, fn)
    # Streams and events: the CPU build has none (see NoStream).
    cuda.Stream, cuda.Event = NoStream, NoEvent
    _STREAMS[:] = [NoStream()]
    cuda.current_stream = lambda device=None: _STREAMS[-1]
    cuda.default_stream = lambda device=None: _STREAMS[0]
    cuda.stream = _on_stream
    cuda.set_stream = lambda stream: _STREAMS.__setitem__(-1, stream or _STREAMS[0])
    # A tensor marked as used by a stream (its memory's reuse deferred): nothing to defer here.
    torch.Tensor.record_stream = _record_stream
    # Backward on the calling thread: for "cuda" tensors autograd runs it on a device thread of
    # its own, started from C++, where coverage cannot follow (the backward's hooks would count
    # as never run).
    torch.autograd.set_multithreading_enabled(False)
    # `onegpu doctor` asks the driver API for its version where nvidia-smi is absent.
    torch._C._cuda_getDriverVersion = lambda: DRIVER_API
    # bitsandbytes (imported by PEFT) asks for the current stream's handle when it loads.
    torch._C._cuda_getCurrentRawStream = lambda device: 0


def _record_stream(tensor, stream) -> None:
    """``Tensor.record_stream`` on a card whose streams order nothing (NoStream)."""


class NoEvent:
    """A CUDA event on a card with no data: what it marks has always happened."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class NoStream:
    """A CUDA stream on a card with no data: each copy or kernel issued on it is done when its
    call returns, so there is nothing to wait for and nothing to order."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        import torch

        self.device = torch.device("cuda", 0)
        self.priority = priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> NoEvent:
        event = event or NoEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_STREAMS: list = []  # the current stream last: [the default stream, streams entered...]


@contextlib.contextmanager
def _on_stream(stream):
    """``torch.cuda.stream(s)``: ``current_stream()`` is ``s`` inside the block."""
    _STREAMS.append(stream or _STREAMS[-1])
    try:
        yield
    finally:
        _STREAMS.pop()


# ---------------------------------------------------------------- fake tensors and their memory
class CudaMemory:
    """Bytes of the live storages of fake "cuda" tensors, and their peak (a TorchDispatchMode sees
    every op's outputs; a storage counts until Python frees it). With ``limit`` set, an op whose
    new storages would take the count past it raises the out-of-memory error a card raises."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self.live = WeakIdKeyDictionary()
        # the live storages' bytes, kept as they come and go: summing `live` at every op made a
        # full-size model's step quadratic (half of a 1B step's 80 s on 2 cores)
        self.held = 0
        self.peak = 0
        self.limit: int | None = None  # bytes; None (the default): never out of memory

    def allocated(self) -> int:
        return self.held

    def _freed(self, nbytes: int) -> None:
        self.held -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.allocated()

    def record(self, out) -> None:
        import torch
        from torch.utils import _pytree as pytree

        new = {}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                st = t.untyped_storage()
                if st not in self.live:
                    new[id(st)] = (st, st.nbytes())
        asked, held = sum(n for _, n in new.values()), self.allocated()
        if self.limit is not None and held + asked > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {asked / 2**20:.2f} MiB. GPU 0 has a total "
                f"capacity of {self.limit / 2**30:.2f} GiB of which "
                f"{max(self.limit - held, 0) / 2**20:.2f} MiB is free. Of the allocated memory "
                f"{held / 2**30:.2f} GiB is allocated by PyTorch."
            )
        for st, n in new.values():
            self.live[st] = n
            self.held += n
            weakref.finalize(st, self._freed, n)
        self.peak = max(self.peak, held + asked)


MEMORY = CudaMemory()


def _card_mode(fake_mode):
    """Above the fake mode: ops on real host tensors run for real (the host side of a step counts
    its target tokens from real labels); ops that touch the card go to the fake mode, and the
    card's memory is counted."""
    import torch
    from torch._subclasses.fake_tensor import (
        FakeTensor,
        disable_fake_tensor_cache,
        unset_fake_temporarily,
    )
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    def on_card(args, kwargs) -> bool:
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, FakeTensor) or (isinstance(x, torch.device) and x.type == "cuda"):
                return True
        return False

    class Card(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # Page-locked host buffers (activation offload) need the CUDA host allocator: fake too.
            if not on_card(args, kwargs) and not kwargs.get("pin_memory"):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(), float()
                return _scalar(args[0].dtype)
            if func is torch.ops.aten.allclose.default:
                return True
            # Real host tensors bound for the card become fake first: the fake mode would run an op
            # whose inputs are all real for real, on a CUDA backend that is not there.
            args, kwargs = pytree.tree_map_only(
                torch.Tensor,
                lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t),
                (args, kwargs),
            )
            # An op given a storage (Tensor.set_) bypasses the fake mode's op cache: the cache's
            # key would hold the storage, and so its bytes on the card, for the whole process.
            leaves = pytree.tree_leaves((args, kwargs))
            if any(isinstance(x, torch.UntypedStorage) for x in leaves):
                with disable_fake_tensor_cache(fake_mode):
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            MEMORY.record(out)
            return out

    return Card()


_VALUES: list[float] = []


def _scalar(dtype):
    import math

    import torch

    value = _VALUES[-1] if _VALUES else VALUE
    if dtype == torch.bool:  # the loop's bool reads ask "is it finite?" (the NaN guard's verdict)
        return math.isfinite(value)
    return value if dtype.is_floating_point or not math.isfinite(value) else int(value)


@contextlib.contextmanager
def fake_value(value: float):
    """``.item()`` (and ``float()``/``bool()``) of a fake tensor reads ``value`` inside the
    block."""
    _VALUES.append(value)
    try:
        yield
    finally:
        _VALUES.pop()


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode for "cuda" tensors, with memory counted and ``.item()`` answered."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # The converter remembers each fake tensor it made from a real one through a weak reference;
    # module.to() on fake parameters (Accelerate's prepare) swaps them in place, which a weak
    # reference forbids. A plain dict remembers them strongly, for the length of the block.
    mode.fake_tensor_converter.meta_converter.tensor_memo = {}
    # An op's output (a fresh meta tensor made fake) went to the same memo, and so lived as long
    # as the block, with its bytes on the card: every op the fake mode's cache had not seen yet
    # (the first layer's intermediates) stayed alive. Nothing looks an op's output up again, so
    # it is made fake without being remembered.
    mode.fake_tensor_converter.from_meta_and_device = _unremembered
    try:
        with mode, _card_mode(mode):
            yield mode
    finally:
        torch.cuda.empty_cache()


def _unremembered(fake_mode, t, device, pytype=None, dispatch_keys=None):
    """The fake tensor for an op's meta output, on ``device``, not remembered by the converter."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


def on_card(model):
    """A model built on the meta device, given fake "cuda" storage (call inside ``fake_cuda``).
    ``to_empty`` unties tied embeddings; tie them again as the real model is."""
    model.to_empty(device="cuda")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def batch(vocab: int, size: int = 2, seq: int = 16, pad: int = 0) -> dict:
    """Random token batch built on the CPU, then moved to the card (``pad`` masked tail tokens)."""
    import torch

    ids = torch.randint(0, vocab, (size, seq))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if pad:
        mask[:, -pad:] = 0
        labels[:, -pad:] = -100
    return {
        k: v.to("cuda")
        for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()
    }
