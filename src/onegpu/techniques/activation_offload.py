"""Activation offload: the tensors autograd saves for backward wait in host memory.

During the forward, every saved tensor whose storage holds at least
``techniques.activation_offload_min_bytes`` is copied to pinned host memory and the device copy
is released; in the backward it is copied back just before the node that needs it runs. This is
the design of torchtune's ``OffloadActivations`` and TRL's ``activation_offloading``
(``torch.autograd.graph.saved_tensors_hooks``), with three choices of our own:

- whole storages move, once: views and repeated saves of one storage (a weight-free activation
  saved by several nodes) share one host copy, and each saved tensor is rebuilt from it as the
  same view (size, stride, offset), so nothing is copied twice or materialised larger;
- on CUDA the copies run on a side stream. Device-to-host: the compute stream goes on at once;
  the device storage is kept alive until its copy is done, for at most ``MAX_IN_FLIGHT`` storages
  (then the compute stream waits for the oldest copy), which bounds the extra memory.
  Host-to-device: when the backward asks for one storage, the next ``PREFETCH`` storages in
  reverse forward order start copying too, so the copies overlap with the backward's compute. The
  buffers they land in are allocated from the side stream's own pool and marked as used by the
  compute stream (``record_stream``), so a prefetch starts as soon as the side stream is free
  instead of waiting for every kernel the compute stream has queued (the backward queues ahead);
  the compute stream waits only for the copy of the storage it is about to read;
- tensors already in host memory (a CPU run) are not copied: they are only booked as host-held,
  and each saved tensor is still rebuilt from its storage, so the bookkeeping is the one a GPU
  run uses.

Weights are never moved (they stay on the device anyway), nor small tensors, nor tensor subclasses.
With checkpointing, what autograd saves is each checkpointed block's inputs (the block's own
intermediates are recomputed), so those are what moves.

The hooks are active while the model's forward runs (a forward pre-hook enters them and a
forward hook that runs even when the forward raises leaves them); the backward reads the saved
tensors through the unpack hook stored with each of them, so it needs no hook of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)

# Device storages kept alive while their copy to the host is under way. More lets the side stream
# fall further behind the compute without a wait; each costs one activation of device memory.
MAX_IN_FLIGHT = 4
# Storages copied back ahead of the one the backward asks for (same trade-off, in backward).
PREFETCH = 2


@dataclasses.dataclass
class OffloadStats:
    """What the last forward saved for backward (bytes of distinct storages), and what its backward
    brought back."""

    kept: int = 0
    """Left on the device: below the size threshold, or not a plain tensor."""
    moved: int = 0
    """Held in host memory until the backward."""
    moved_storages: int = 0
    """How many storages ``moved`` counts."""
    in_flight: int = 0
    """Bytes of moved storages whose device copy was still alive when the forward ended: copies
    under way, at most ``MAX_IN_FLIGHT`` storages (0 off CUDA, where copies are synchronous)."""
    fetched: int = 0
    """Storages the backward copied back to the device: the moved ones not still in flight."""
    prefetched: int = 0
    """Of ``fetched``, those started ahead of the node that needed them."""


class _Stored:
    """One storage the forward saved: its host copy, and its device copy while there is one."""

    def __init__(self, storage, device: torch.device, index: int):
        self.device = device
        self.nbytes = storage.nbytes()
        self.index = index  # position in forward order: the backward runs the other way
        self.host = None  # a uint8 tensor in host memory
        self.on_device = None  # a uint8 tensor over the device storage, or its copy back
        self.ready = None  # CUDA event: the copy in flight is done
        self.pending = 0  # saved tensors not yet unpacked


class _Forward:
    """The storages one forward moved, in order; the handles of its saved tensors refer to it,
    so it lives exactly as long as that forward's autograd graph (no reference cycle: the host
    memory goes back as soon as the graph does)."""

    def __init__(self):
        self.order: list[_Stored] = []
        self.moved: dict = {}  # StorageWeakRef -> _Stored
        self.small: set = set()  # StorageWeakRefs of storages left on the device (for the stats)


@dataclasses.dataclass
class _Saved:
    """What autograd keeps instead of a moved tensor: the storage and the view into it."""

    stored: _Stored
    forward: _Forward
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    offset: int


def _key(storage) -> StorageWeakRef:
    """A storage's identity: a weak reference to the storage object itself, equal for every view
    and every Python handle of it. Not its address: while the key lives no other storage can
    take its place (the weak reference keeps the storage object, not its memory), and a tensor
    with no memory of its own (a FakeTensor: torch's tracing) has address 0."""
    return StorageWeakRef(storage)


def _bytes_of(storage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (no copy). ``device`` is the tensor's: a
    FakeTensor's storage reports "meta" while the tensor stands for one on ``device``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


_ATTR = "_activation_offload"


def attached(model) -> ActivationOffload | None:
    """The activation offload attached to ``model``, if any."""
    return vars(model).get(_ATTR)


def apply_activation_offload(model, tcfg, device_type: str):
    """Offload the model's saved activations when ``tcfg.activation_offload`` is on; returns the
    model (hooks are added in place)."""
    if not tcfg.activation_offload:
        return model
    if device_type == "cpu":
        log.warning(
            "activation_offload on CPU: activations already live in host memory; saved tensors "
            "are only booked as host-held, nothing is copied"
        )
    ActivationOffload(model, tcfg.activation_offload_min_bytes).attach()
    log.info(
        "activation offload: saved tensors of %d bytes or more wait in host memory for the "
        "backward",
        tcfg.activation_offload_min_bytes,
    )
    return model


class ActivationOffload:
    """The pack / unpack hooks of one model, and the streams they copy on."""

    def __init__(self, model: torch.nn.Module, min_bytes: int):
        self.model = model
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._weights: set = set()
        self._forward: _Forward | None = None
        self._in_flight: collections.deque = collections.deque()
        self._stream = None  # the side stream, made on the first CUDA copy
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def attach(self) -> ActivationOffload:
        """Enter the hooks at each forward of the model and leave them at its end; the model
        keeps this object (``attached``: its stats)."""
        self.model.register_forward_pre_hook(self.enter)
        self.model.register_forward_hook(self.leave, always_call=True)
        vars(self.model)[_ATTR] = self
        return self

    # ---- the forward: enter and leave the hooks ----------------------------------------------
    def enter(self, module, args) -> None:
        if not torch.is_grad_enabled():  # evaluation or a reference pass: nothing is saved
            return
        self._weights = {
            _key(t.untyped_storage()) for t in (*self.model.parameters(), *self.model.buffers())
        }
        self.stats = OffloadStats()
        self._release_in_flight()  # a forward whose backward never ran (its graph was dropped)
        self._forward = _Forward()
        self._hooks.__enter__()

    def leave(self, module, args, output) -> None:
        if self._forward is None:
            return
        self._hooks.__exit__(None, None, None)
        self.stats.in_flight = sum(s.nbytes for s in self._in_flight)
        self._forward = None  # the graph's handles keep what they need; nothing else may

    # ---- pack: in the forward ----------------------------------------------------------------
    def pack(self, tensor: torch.Tensor):
        fwd = self._forward
        if fwd is None or not _plain(tensor) or tensor.device.type == "meta":
            return tensor
        if torch.compiler.is_compiling():  # torch.compile's tracing: its fake tensors hold no data
            return tensor
        storage = tensor.untyped_storage()
        key = _key(storage)
        if key in self._weights:
            return tensor
        stored = fwd.moved.get(key)
        if stored is None:
            if storage.nbytes() < self.min_bytes:
                if key not in fwd.small:  # count each storage once
                    fwd.small.add(key)
                    self.stats.kept += storage.nbytes()
                # Detached, as torch asks of a pack hook's result: an output its own node saves
                # (rsqrt's, softmax's) would hold that node, and the node it, so a graph dropped
                # before its backward (an evaluation with gradients on) would never be freed.
                return tensor.detach()
            stored = _Stored(storage, tensor.device, len(fwd.order))
            self._to_host(stored, storage)
            fwd.order.append(stored)
            fwd.moved[key] = stored
            self.stats.moved += stored.nbytes
            self.stats.moved_storages += 1
        stored.pending += 1
        return _Saved(
            stored, fwd, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()
        )

    def _to_host(self, stored: _Stored, storage) -> None:
        if stored.device.type == "cpu":  # already host memory: book it, copy nothing
            stored.host = _bytes_of(storage, stored.device)
            return
        source = _bytes_of(storage, stored.device)
        stored.host = torch.empty(stored.nbytes, dtype=torch.uint8, pin_memory=True)
        if stored.device.type != "cuda":  # another accelerator: a plain synchronous copy
            stored.host.copy_(source)
            return
        compute, side = torch.cuda.current_stream(stored.device), self._side_stream(stored.device)
        side.wait_stream(compute)  # the tensor's producer has run
        with torch.cuda.stream(side):
            stored.host.copy_(source, non_blocking=True)
            stored.ready = side.record_event()
        # The device storage lives until its copy is done; beyond MAX_IN_FLIGHT, release the
        # oldest once the compute stream has waited for its copy (its memory is not reused early).
        stored.on_device = source
        self._in_flight.append(stored)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            old = self._in_flight.popleft()
            compute.wait_event(old.ready)
            old.on_device = None

    def _release_in_flight(self) -> None:
        while self._in_flight:
            old = self._in_flight.popleft()
            torch.cuda.current_stream(old.device).wait_event(old.ready)
            old.on_device = None

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # ---- unpack: in the backward -------------------------------------------------------------
    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        stored = saved.stored
        data = self._device_bytes(stored, saved.forward)
        tensor = torch.empty(0, dtype=saved.dtype, device=stored.device)
        tensor.set_(data.untyped_storage(), saved.offset, saved.size, saved.stride)
        stored.pending -= 1
        if stored.pending <= 0:  # the last saved tensor of this storage: the graph holds it now
            stored.on_device = None
        return tensor

    def _device_bytes(self, stored: _Stored, fwd: _Forward) -> torch.Tensor:
        if stored.device.type == "cpu":
            return stored.host
        if stored.device.type != "cuda":
            return (
                stored.on_device if stored.on_device is not None else stored.host.to(stored.device)
            )
        # the backward has begun: what is still on the device stays there until used
        self._in_flight.clear()
        compute = torch.cuda.current_stream(stored.device)
        if stored.on_device is None:
            self._fetch(stored, compute)
        for ahead in _next_in_backward(fwd, stored):
            self._fetch(ahead, compute)
            self.stats.prefetched += 1
        if stored.ready is not None:
            compute.wait_event(stored.ready)
        return stored.on_device

    def _fetch(self, stored: _Stored, compute) -> None:
        """Start the copy of one storage back to the device on the side stream. The buffer comes
        from the side stream's pool, so no kernel still queued on the compute stream can be using
        its memory and the copy need not wait for them; ``record_stream`` keeps the allocator from
        handing it out again before the compute stream's kernels that read it have run."""
        side = self._side_stream(stored.device)
        with torch.cuda.stream(side):
            buffer = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
            buffer.copy_(stored.host, non_blocking=True)
            stored.ready = side.record_event()
        buffer.record_stream(compute)
        stored.on_device = buffer
        self.stats.fetched += 1


def _plain(tensor: torch.Tensor) -> bool:
    """A strided tensor whose storage holds its values: a plain tensor, or a FakeTensor standing
    for one (torch's tracing and shape propagation). Other subclasses (a quantized weight, a
    DTensor) keep their own storage logic and are left alone."""
    return type(tensor) in (torch.Tensor, FakeTensor) and tensor.layout == torch.strided


def _next_in_backward(fwd: _Forward, stored: _Stored) -> list:
    """The PREFETCH storages saved just before this one (the backward's next) not on the device."""
    ahead = fwd.order[max(0, stored.index - PREFETCH) : stored.index][::-1]
    return [s for s in ahead if s.on_device is None and s.pending > 0]
