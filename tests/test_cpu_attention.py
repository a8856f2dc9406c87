"""A compiled CPU decode step's attention as inductor loops: SDPA's numbers, and the loops really
run in the step (no SDPA call) with the eager tokens."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from families import tiny_family_model
from onegpu.infer import cpu_attention
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams


def _sdpa(q, k, v, mask, scale):
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def test_decode_is_sdpa_for_grouped_and_plain_heads_bool_and_additive_masks():
    torch.manual_seed(0)
    lengths = torch.tensor([40, 7, 23, 1])
    allowed = (torch.arange(40)[None] < lengths[:, None])[:, None, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for heads, kv_heads in ((6, 2), (4, 4)):
        q, k, v = (
            torch.randn(4, heads, 1, 16),
            torch.randn(4, kv_heads, 40, 16),
            torch.randn(4, kv_heads, 40, 16),
        )
        want = _sdpa(q, k, v, allowed, 0.3)
        for mask in (allowed, additive):
            got = cpu_attention.decode(q, k, v, mask, 0.3)
            assert got.shape == (4, 1, heads, 16)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        compiled = torch.compile(cpu_attention.decode, backend="inductor", dynamic=False)
        torch.testing.assert_close(compiled(q, k, v, allowed, 0.3), want, rtol=1e-5, atol=1e-6)


def test_a_row_with_nothing_to_attend_gets_zeros_and_a_bf16_cache_stays_bf16():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.tensor([[True] * 5, [False] * 5])[:, None, None]
    got = cpu_attention.decode(q, k, v, allowed, 0.5)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.isfinite(got).all()
    half = cpu_attention.decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), allowed, 0.5)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half[0].float(), got[0], rtol=2e-2, atol=2e-2)


def test_outside_a_compiled_step_the_call_goes_to_sdpa():
    """Eagerly (a LoRA step through PEFT's hooks) the loops would build [rows, heads, positions,
    head_dim] in memory: the function hands the call to SDPA instead."""

    class Layer(torch.nn.Module):
        num_key_value_groups = 1
        is_causal = True

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu_attention.attention_forward(Layer(), q, k, v, allowed, scaling=0.5)
    assert any("scaled_dot_product" in e.name for e in prof.events())


def _decode_sdpa_calls(engine, ids, params):
    """The greedy tokens; the SDPA calls of the compiled decode steps (a compiled graph calls the
    kernel, aten::_scaled_dot_product_*, directly — or through aoti_torch_cpu_* from a C++
    wrapper — where an eager prefill goes through aten::scaled_dot_product_attention first); the
    inductor kernels with an exp in them (the loops')."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        tokens = [r.token_ids for r in engine.generate(ids, params)]
    names = [e.name for e in prof.events()]
    kernel = [n for n in names if n.startswith("aten::_scaled_dot_product")]
    eager = names.count("aten::scaled_dot_product_attention")
    decode = [n for n in names if n.startswith("aoti_torch_cpu__scaled_dot_product")]
    decode += kernel[: max(0, len(kernel) - eager)]
    loops = [n for n in names if "cpp_fused" in n and "_exp_" in n]
    return tokens, len(decode), loops


@pytest.mark.slow
def test_a_compiled_cpu_step_attends_in_loops_with_the_eager_tokens(tiny_tokenizer):
    """Compiled steps of 2 rows and of 1 call no SDPA and attend in an inductor kernel with the
    softmax's exp in it (over the paged pool the loops read the blocks where they lie, where SDPA
    would need them gathered first: benchmarks/results/paged-attention-cpu.md); with the policy
    row off, SDPA's kernel; the greedy tokens are the eager engine's either way."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    ids = [tiny_tokenizer(p)["input_ids"] for p in ("def add(a, b):", "import os\nimport")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eager = Engine(model, None, EngineConfig(max_slots=2, max_len=64))
    want = [r.token_ids for r in eager.generate(ids, params)]
    alone = [r.token_ids for r in eager.generate(ids[:1], params)]
    compiled = Engine(model, None, EngineConfig(max_slots=2, max_len=64, compile="on"))
    sdpa_step = EngineConfig(max_slots=1, max_len=64, compile="on")
    sdpa_step.policy_off = ["cpu_attention_loops"]
    plain = Engine(model, None, sdpa_step)
    assert compiled.stats().decode_attention == cpu_attention.NAME
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled.generate(ids, params)  # compiles both buckets, the kernels named in the profile
        compiled.generate(ids[:1], params)
        plain.generate(ids[:1], params)
    for batch, ref in ((ids, want), (ids[:1], alone)):
        got, sdpa, loops = _decode_sdpa_calls(compiled, batch, params)
        assert got == ref and sdpa == 0 and loops
    got, sdpa, loops = _decode_sdpa_calls(plain, ids[:1], params)
    assert got == alone and sdpa > 0 and not loops


def test_a_compiled_decode_computes_the_query_once_not_at_every_key_position():
    """The query's producers (here, as in a model, its rotary embedding: cos and sin of the
    positions) run before the loop over the key positions: the query is a buffer of its own
    (inductor's layout prim), where inductor would otherwise fuse them into that loop and compute
    them again at each of its positions. The values are the eager ones."""
    from torch._inductor.utils import run_and_get_code

    cpu_attention.register(compiled=True)

    def rope_then_attend(x, positions, k, v, allowed):
        freqs = positions[:, None, None, None].float() * torch.arange(1, 9) / 8.0
        angles = torch.cat([freqs, freqs], dim=-1)
        half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
        q = x * angles.cos() + half * angles.sin()
        return cpu_attention.decode(q, k, v, allowed, 0.25)

    torch.manual_seed(0)
    x, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 48, 16), torch.randn(3, 2, 48, 16)
    positions = torch.tensor([47, 20, 3])
    allowed = (torch.arange(48)[None] <= positions[:, None])[:, None, None]
    want = rope_then_attend(x, positions, k, v, allowed)
    torch._dynamo.reset()
    compiled = torch.compile(rope_then_attend, backend="inductor", dynamic=False)
    got, (code,) = run_and_get_code(compiled, x, positions, k, v, allowed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "inductor_force_stride_order" in code  # the prim reached inductor's kernels
    # cos is computed before the first loop over the 48 key positions, not inside it
    assert code.index(".cos()") < code.index("(48L)")
