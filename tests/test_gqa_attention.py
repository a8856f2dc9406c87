"""The engine's GQA decode attention: SDPA over the cache as it is, no repeat_kv copy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from families import tiny_family_model
from onegpu.infer import gqa_attention
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams


class _Layer(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def test_grouped_heads_attend_as_sdpa_over_repeated_keys():
    """4 rows at different lengths, 6 query heads over 2 key heads: the output equals SDPA's
    over keys repeated for each query head (transformers' repeat_kv), which this path never
    builds."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 6, 1, 16), torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16)
    allowed = (torch.arange(40)[None] < torch.tensor([40, 7, 23, 1])[:, None])[:, None, None]
    got, _ = gqa_attention.attention_forward(_Layer(), q, k, v, allowed, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=allowed, scale=0.3
    )
    assert got.shape == (4, 1, 6, 16)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_prefill_goes_to_transformers_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    got, _ = gqa_attention.attention_forward(_Layer(), q, k, v, causal)
    want, _ = sdpa_attention_forward(_Layer(), q, k, v, causal)
    assert torch.equal(got, want)


def _sdpa_query_heads(engine, ids, params):
    """The greedy tokens, and the query's head count in every SDPA call of the decode steps (2
    rows; each prefill has one)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        tokens = [r.token_ids for r in engine.generate(ids, params)]
    heads = [
        e.input_shapes[0][1]
        for e in prof.events()
        if "scaled_dot_product" in e.name and e.input_shapes and e.input_shapes[0][0] == 2
    ]
    return tokens, heads


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_engine_decode_steps_read_the_kv_heads_as_they_are(compile_mode, tiny_tokenizer):
    """A GQA model (4 query heads over 2 key heads): with the gqa_decode row, SDPA gets the
    decode steps' queries packed by key head (2 heads of 2 "tokens") and the cache's 2 heads,
    eager and compiled; the greedy tokens are transformers' own SDPA path's, which a CPU's
    policy keeps (the row is CUDA's); the model after the steps keeps transformers' SDPA."""
    model = tiny_family_model("llama", tiny_tokenizer).eval()
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    ids = [tiny_tokenizer(p)["input_ids"] for p in ("def add(a, b):", "import os\nimport")]
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    config = EngineConfig(max_slots=2, max_len=64, compile=compile_mode)
    if compile_mode == "on":
        config.compile_backend = "aot_eager"
    reference = Engine(model, None, config)
    assert "gqa_decode" not in reference.stats().policy_rows  # a CPU's policy: the row is CUDA's
    want, before = _sdpa_query_heads(reference, ids, params)
    # transformers' SDPA: eagerly it packs a one-token query by key head itself (pack_gqa, 5.24);
    # inside a compiled step it repeats the keys for the query's 4 heads (repeat_kv)
    assert before and set(before) == ({4} if compile_mode == "on" else {2})
    # the row switched on here (EngineConfig.policy_on), as on a GPU
    engine = Engine(model, None, dataclasses.replace(config, policy_on=["gqa_decode"]))
    got, heads = _sdpa_query_heads(engine, ids, params)
    assert got == want
    assert heads and set(heads) == {2}
    assert model.config._attn_implementation == "sdpa"
