"""A compiled decode step's one-row matmuls with few outputs as inductor reductions, not cuBLAS.

At batch 1 a decode step multiplies one row by each weight. The library's GEMM kernels tile the
weight's outputs, so a weight with few outputs runs on few of the card's SMs. Written as a multiply
and a sum over the shared dimension, the same product becomes an inductor reduction spread over
every SM. On an H200 (``benchmarks/results/h200-20261126/``, bf16, µs a call, cuBLAS against the
reduction), the 1b preset's weights [outputs, inputs]:

- one row: k, v [512, 2048] 4.9 / 2.0; q, o [2048, 2048] 5.0 / 3.9; down [2048, 8192] 11.3 / 7.1;
  but gate, up [8192, 2048] 8.4 / 11.5 — enough outputs to fill the card, cuBLAS is at 4 TB/s;
- 8 rows: slower in every case (k, v 5.1 / 5.9 up to gate, up 6.7 / 73): each row reads the
  weight again;
- inside the step, the down projection's reduction took 20 µs: inductor fused the SiLU and the
  product before it into the reduction's loads. Only k, v, q and o then gain: the decode step
  at batch 1 took 1.40 ms against 1.59 with cuBLAS for all (1.46 with down rewritten too).

:class:`SmallGemv` is a graph pass (inductor's ``post_grad_custom_pre_pass``) that rewrites each
``mm`` of at most ``max_rows`` rows, ``max_outputs`` outputs (and at least ``min_outputs``) and
``max_inputs`` inputs on one device type — by default what was measured to gain: one row, weights
up to [2048, 2048]; products in fp32, the result in the matmul's dtype (cuBLAS's bf16 GEMM
accumulates in fp32 too).

On a CPU the other end gains (``head``): the output head (the vocabulary's 32,000 outputs) as
inductor's vectorised C++ reduction, its loops over the weight's rows outermost, so each row of
the weight is read once for every row of the batch while it is in the L1 cache (``outputs_outer``).
Against MKL's matmul, fp32, one thread, compiled with the argmax after it, timed standalone on a
loaded machine: a [32000, 128] head 4.1x at 1 row, 1.9x at 4 and 1.5x at 16; a [32000, 768] head
2.0x at 1 row and 1.14x at 16. In the engine's step
(benchmarks/results/engine-head-reduction-cpu.md, engine-decode-speed-cpu.md) it gains at one
row and loses at 16 (a dot product of 128 terms an output, summed across the
vector's lanes, against MKL's register-blocked GEMM): one row only. The layers' small matmuls
lose to MKL's call, and stay with it.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten, prims = torch.ops.aten, torch.ops.prims


class SmallGemv(CustomGraphPass):
    def __init__(
        self,
        device="cuda",
        max_rows=1,
        max_outputs=2048,
        max_inputs=2048,
        min_outputs=0,
        outputs_outer=False,
    ):
        """``outputs_outer``: the product computed as [outputs, rows] and transposed, so that
        inductor's loops run over the weight's rows outermost and read each once for all rows."""
        self.device, self.max_rows = device, max_rows
        self.max_outputs, self.max_inputs = max_outputs, max_inputs
        self.min_outputs, self.outputs_outer = min_outputs, outputs_outer
        self.rewritten = 0  # matmuls this pass turned into reductions, over every graph it saw

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.mm.default and self._small(node):
                self._rewrite(graph, node)
                self.rewritten += 1

    def _small(self, node) -> bool:
        a, b = (getattr(arg, "meta", {}).get("val") for arg in node.args)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return False
        static = all(isinstance(d, int) for d in (*a.shape, *b.shape))
        return (
            static
            and a.device.type == b.device.type == self.device
            and a.dtype == b.dtype
            and a.shape[0] <= self.max_rows
            and self.min_outputs <= b.shape[1] <= self.max_outputs
            and b.shape[0] <= self.max_inputs
        )

    def _rewrite(self, graph: torch.fx.Graph, node) -> None:
        """mm(a [m, k], b [k, n]) -> sum(a[:, :, None] * b[None], 1), in fp32, cast back; with
        ``outputs_outer`` sum(b.t()[:, None] * a[None], 2).t()."""
        a, b = node.args
        dtype = node.meta["val"].dtype
        fake = torch._guards.detect_fake_mode([a.meta["val"], b.meta["val"]])

        def add(target, *args):
            new = graph.call_function(target, args)
            vals = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in args]
            with fake:
                new.meta["val"] = target(*vals)
            return new

        with graph.inserting_before(node):
            a32 = add(prims.convert_element_type.default, a, torch.float32)
            b32 = add(prims.convert_element_type.default, b, torch.float32)
            if self.outputs_outer:
                bt = add(aten.permute.default, b32, [1, 0])
                prod = add(
                    aten.mul.Tensor,
                    add(aten.unsqueeze.default, bt, 1),
                    add(aten.unsqueeze.default, a32, 0),
                )
                total = add(aten.permute.default, add(aten.sum.dim_IntList, prod, [2]), [1, 0])
            else:
                prod = add(
                    aten.mul.Tensor,
                    add(aten.unsqueeze.default, a32, 2),
                    add(aten.unsqueeze.default, b32, 0),
                )
                total = add(aten.sum.dim_IntList, prod, [1])
            out = add(prims.convert_element_type.default, total, dtype)
        node.replace_all_uses_with(out)
        graph.erase_node(node)

    def uuid(self):
        return (
            get_hash_for_files((__file__,)),
            self.device,
            self.max_rows,
            self.max_outputs,
            self.max_inputs,
            self.min_outputs,
            self.outputs_outer,
        )


def head(device: str = "cpu") -> SmallGemv:
    """The pass that rewrites only a one-row product with the output head (8,192 outputs or
    more), the weight's rows outermost (a CPU's gain: above)."""
    big = 1 << 30
    return SmallGemv(device, 1, big, big, min_outputs=8192, outputs_outer=True)
