"""small_gemv: a compiled decode step's small matmuls as inductor reductions (on a GPU; here the
same pass pointed at the CPU, where inductor generates the reduction as C++ instead of Triton)."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from families import tiny_family_model
from onegpu.infer import small_gemv
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams
from onegpu.infer.small_gemv import SmallGemv

F = torch.nn.functional


def _compiled(fn, gemv: SmallGemv, *args):
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=gemv, fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(fn, dynamic=False), *args)
    return out, "\n".join(code)


def test_matmuls_with_few_outputs_become_reductions_and_wide_ones_stay_library_calls():
    """3 rows times a [48, 64] and a [400, 64] weight, at most 48 outputs rewritten: the generated
    code calls the library's mm once (the wide weight), and both products equal F.linear's."""
    torch.manual_seed(0)
    x, small, large = torch.randn(3, 64), torch.randn(48, 64), torch.randn(400, 64)
    gemv = SmallGemv("cpu", max_rows=4, max_outputs=48)
    (a, b), code = _compiled(lambda x: (F.linear(x, small), F.linear(x, large)), gemv, x)
    assert gemv.rewritten == 1
    assert code.count("extern_kernels.mm(") == 1
    torch.testing.assert_close(a, F.linear(x, small), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, F.linear(x, large))


def test_more_rows_than_the_limit_keep_the_library_matmul():
    """The default: one row only (at 8 rows the reduction lost to cuBLAS on every shape)."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 64), torch.randn(48, 64)
    gemv = SmallGemv("cpu")
    out, code = _compiled(lambda x: F.linear(x, w), gemv, x)
    assert gemv.rewritten == 0 and code.count("extern_kernels.mm(") == 1
    torch.testing.assert_close(out, F.linear(x, w))


def test_a_half_precision_product_accumulates_in_fp32_and_keeps_its_dtype():
    """bf16 in, bf16 out, within one bf16 rounding of the fp32 product (a bf16 accumulation over
    2,048 terms would be off by far more)."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 2048, dtype=torch.bfloat16), torch.randn(64, 2048, dtype=torch.bfloat16)
    gemv = SmallGemv("cpu")
    out, _ = _compiled(lambda x: F.linear(x, w), gemv, x)
    assert gemv.rewritten == 1 and out.dtype == torch.bfloat16
    exact = x.float() @ w.float().t()
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)


def test_a_compiled_engine_step_with_the_pass_gives_the_same_greedy_tokens(tiny_tokenizer):
    """The engine's compiled decode step (inductor) with the small_gemv row switched on here
    (``policy_on``: a GPU's row on a CPU) at one row: the pass rewrote every matmul of the tiny
    Llama's layers and the greedy tokens are the eager engine's."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    ids = [tiny_tokenizer(p)["input_ids"] for p in ("def add(a, b):", "import os\nimport")]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = [
        r.token_ids
        for r in Engine(model, None, EngineConfig(1, 64, compile="off")).generate(ids, params)
    ]
    engine = Engine(model, None, EngineConfig(1, 64, compile="on", policy_on=["small_gemv"]))
    assert "small_gemv" in engine.stats().policy_rows
    # fx_graph_cache off: a graph inductor cached from an earlier run would skip the pass
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = [r.token_ids for r in engine.generate(ids, params)]
    # q k v o gate up down, a layer
    assert engine.stats().matmul_rewrites >= 7 * model.config.num_hidden_layers
    assert got == want


def test_the_cpu_head_pass_rewrites_the_output_head_alone_at_one_row():
    """small_gemv.head: of a [8192, 64] head and a [48, 64] weight only the head becomes a
    reduction (its weight's rows outermost, then transposed), at one row and not at two; the
    products equal F.linear's."""
    torch.manual_seed(0)
    head, small = torch.randn(8192, 64), torch.randn(48, 64)
    for rows, rewritten in ((1, 1), (2, 0)):
        x = torch.randn(rows, 64)
        gemv = small_gemv.head()
        (a, b), code = _compiled(lambda x: (F.linear(x, head), F.linear(x, small)), gemv, x)
        assert gemv.rewritten == rewritten
        assert code.count("extern_kernels.mm(") == 2 - rewritten
        torch.testing.assert_close(a, F.linear(x, head), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, F.linear(x, small))


def test_a_compiled_cpu_engine_step_multiplies_by_the_head_as_the_policy_row_says(tiny_tokenizer):
    """The cpu_head_reduction row: a compiled CPU engine's step over an 8,192-token head runs
    the head's pass, which rewrote that product (one a graph), with the eager engine's greedy
    tokens; with the row off the step has no pass."""
    model = tiny_family_model("llama", tiny_tokenizer, vocab_size=8192).eval()
    ids = [[5, 6, 7, 8]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eager = Engine(model, None, EngineConfig(1, 64, compile="off"))
    want = [r.token_ids for r in eager.generate(ids, params)]
    engine = Engine(model, None, EngineConfig(1, 64, compile="on"))
    assert "cpu_head_reduction" in engine.stats().policy_rows  # a CPU's: small_gemv is not
    assert "small_gemv" not in engine.stats().policy_rows
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cached graph skips the pass
        got = [r.token_ids for r in engine.generate(ids, params)]
    assert engine.stats().matmul_rewrites >= 1
    assert got == want
    off = Engine(model, None, EngineConfig(1, 64, compile="on", policy_off=["cpu_head_reduction"]))
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert [r.token_ids for r in off.generate(ids, params)] == want
    assert off.stats().matmul_rewrites == 0 and off.stats().compiled_shapes  # compiled, no pass
