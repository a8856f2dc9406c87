"""What a forward leaves alive for backward, op by op: ``_Tracker`` records every storage an op
creates (and which op made it from which inputs) while a forward runs, so the activation model
(activations.py) can sum those still alive once it returns, eager, and as compiled code would keep
them (``compiled_alive``, the mechanism the activations.py docstring describes).

Tensor subclasses (torchao's float8 training tensors: a float8 payload and its scale behind a
wrapper of the original dtype) are counted by their inner tensors, the storages that really hold
bytes; a matmul of such tensors is skipped like any other, its output made from the shapes alone.
"""

from __future__ import annotations

MATMULS = ("mm.default", "addmm.default", "bmm.default", "baddbmm.default")
# Any other op on a floating tensor this large is made from shapes alone too: at full width the
# fused loss's weight-sized gradient buffer (zeroed, accumulated, cast back), FP8's scales of the
# weights and a log-softmax over a 128k vocabulary cost seconds each on a CPU, and their values,
# like the uninitialised weights they come from, never matter. Below it, running the op is cheaper
# than its meta round trip; the bytes kept are the same either way (tests/test_plan_activations.py).
SKIP_NUMEL = 1 << 20
# Ops compiled code recomputes in backward rather than saving their outputs, beside every op tagged
# pointwise: casts, copies and concatenations (inductor fuses them into their consumers).
RECOMPUTED = {"_to_copy", "clone", "cat", "stack", "copy", "_unsafe_view", "repeat", "expand_copy"}
# ...except a tensor a matmul or attention kernel reads: its backward needs it materialized, so the
# partitioner saves it (torch/_functorch/partitioners.py, "materialized in backward").
HEAVY = {"mm", "addmm", "bmm", "baddbmm"}


class _Tracker:
    """Records every storage an op creates, to sum those still alive later."""

    def __init__(self, skip_matmul: bool, exclude: frozenset = frozenset()):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = tracker._run(func, args, kwargs) if skip_matmul else func(*args, **kwargs)
                tracker._record(out, func, (args, kwargs))
                return out

        self.mode = Mode()
        self.refs: dict = {}  # storage key -> (weak ref, bytes)
        # Storage keys are addresses and get reused once freed, so each new storage gets a serial:
        # serial -> (recomputed by compiled code?, serials of the op's inputs, bytes).
        self.serial: dict = {}
        self.made: dict = {}
        self.exclude = exclude  # weights, buffers and inputs: there before forward, never counted
        self.read_by_heavy: set = set()  # serials a matmul or attention kernel took as input
        self.skipped = 0  # ops beside the matmuls made from shapes alone (_skip_large)

    def _run(self, func, args, kwargs):
        import torch
        from torch.utils import _pytree as pytree

        if (
            func.__name__ == "_to_copy.default"
            and args[0].is_floating_point()
            and kwargs.get("device") in (None, args[0].device)
        ):
            # dtype casts (autocast's weight copies, a gradient cast back to its weight's dtype,
            # which names the device it stays on): allocate, don't convert; values never matter
            dtype = kwargs.get("dtype") or args[0].dtype
            if dtype.is_floating_point:
                return torch.empty_strided(
                    args[0].shape, args[0].stride(), dtype=dtype, device=args[0].device
                )
        if func.__name__ in MATMULS:
            # Same output shape, dtype and strides as the real kernel, without the FLOPs: the
            # values never matter for how many bytes are kept.
            meta = func(
                *pytree.tree_map_only(torch.Tensor, _on_meta, args),
                **pytree.tree_map_only(torch.Tensor, _on_meta, kwargs),
            )
            return torch.empty_strided(
                meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device
            )
        skipped = _skip_large(func, args, kwargs)
        if skipped is None:
            return func(*args, **kwargs)
        self.skipped += 1
        return skipped[0]

    def _record(self, out, func=None, inputs=()) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils import _pytree as pytree

        def storages(tree):
            return [
                t.untyped_storage()
                for leaf in pytree.tree_leaves(tree)
                if isinstance(leaf, torch.Tensor)
                for t in _inner(leaf)
                if t.device.type != "meta"
            ]

        ins = {self.serial[st._cdata] for st in storages(inputs) if st._cdata in self.serial}
        recomputed = func is not None and _recomputed(func)
        if func is not None and _heavy(func):
            self.read_by_heavy |= ins
        for st in storages(out):
            key = st._cdata
            if key in self.exclude:  # a view of a weight or an input
                continue
            if key not in self.refs or self.refs[key][0].expired():  # a new storage, not a view
                self.serial[key] = len(self.made)
                self.made[len(self.made)] = (recomputed, ins - {self.serial[key]}, st.nbytes())
            self.refs[key] = (StorageWeakRef(st), st.nbytes())

    def alive(self, exclude: set) -> int:
        return sum(
            n for key, (ref, n) in self.refs.items() if key not in exclude and not ref.expired()
        )

    def compiled_alive(self, exclude: set) -> int:
        """Bytes compiled code would keep instead: each alive tensor an elementwise op made is
        replaced by the heavy outputs it can be recomputed from (through chains of such ops);
        weights and inputs are there anyway and cost nothing."""
        todo = [
            self.serial[k]
            for k, (ref, _) in self.refs.items()
            if k not in exclude and not ref.expired()
        ]
        seen, kept = set(), 0
        while todo:
            s = todo.pop()
            if s in seen or s not in self.made:
                continue
            seen.add(s)
            recomputed, ins, nbytes = self.made[s]
            if recomputed and ins and s not in self.read_by_heavy:
                todo.extend(ins)
            else:
                kept += nbytes
        return kept


def _skip_large(func, args, kwargs):
    """(the op's result made from shapes alone,) for an op on a floating tensor of at least
    SKIP_NUMEL elements, else None (run it). An in-place op returns its target untouched; an op
    that makes new tensors gets empty ones of the shapes, strides and dtypes it computes on the
    meta device. Views (their bytes are their base's), ops on wrapper subclasses (FP8's tensors
    keep their own structure), ops that take a device and ops the meta device cannot run (sizes
    that depend on values) run for real."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not any(t.is_floating_point() and t.numel() >= SKIP_NUMEL for t in leaves):
        return None
    if "device" in kwargs or any(is_traceable_wrapper_subclass(t) for t in leaves):
        return None
    schema = func._schema
    writes = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if writes:
        first = schema.arguments[0] if schema.arguments else None
        inplace = (
            len(schema.returns) == 1
            and writes[0].is_write
            and first is not None
            and first.alias_info is not None
            and first.alias_info.is_write
            and not first.kwarg_only
            and args
            and args[0].is_floating_point()
        )
        return (args[0],) if inplace else None  # a view or an out= variant: run it
    try:
        meta = func(
            *pytree.tree_map_only(torch.Tensor, _on_meta, args),
            **pytree.tree_map_only(torch.Tensor, _on_meta, kwargs),
        )
    except Exception:  # noqa: BLE001 - a size that depends on values, or no meta kernel
        return None
    device = leaves[0].device
    return (
        pytree.tree_map_only(
            torch.Tensor,
            lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device),
            meta,
        ),
    )


def _on_meta(t):
    """A plain meta tensor of ``t``'s shape, strides and dtype (a subclass reports its outer
    dtype: a float8 training tensor, the dtype its matmul writes)."""
    import torch

    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _inner(t) -> list:
    """The plain tensors holding ``t``'s bytes: itself, or a wrapper subclass's inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _inner(getattr(t, n))]


def _heavy(func) -> bool:
    name = func.__name__.split(".")[0]
    return name in HEAVY or "attention" in name


def _recomputed(func) -> bool:
    import torch

    return torch.Tag.pointwise in func.tags or func.__name__.split(".")[0] in RECOMPUTED
