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

    def _run(self, func, args, kwargs):
        import torch
        from torch.utils import _pytree as pytree

        if (
            func.__name__ == "_to_copy.default"
            and args[0].is_floating_point()
            and not kwargs.get("device")
        ):
            # dtype casts (autocast's weight copies): allocate, don't convert; values never matter
            dtype = kwargs.get("dtype") or args[0].dtype
            if dtype.is_floating_point:
                return torch.empty_strided(
                    args[0].shape, args[0].stride(), dtype=dtype, device=args[0].device
                )
        if func.__name__ not in MATMULS:
            return func(*args, **kwargs)
        # Same output shape, dtype and strides as the real kernel, without the FLOPs: the values
        # never matter for how many bytes are kept.
        meta = func(
            *pytree.tree_map_only(torch.Tensor, _on_meta, args),
            **pytree.tree_map_only(torch.Tensor, _on_meta, kwargs),
        )
        return torch.empty_strided(
            meta.shape, meta.stride(), dtype=meta.dtype, device=args[0].device
        )

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
