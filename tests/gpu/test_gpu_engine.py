"""The decode engine on a CUDA GPU: its step captured and replayed as CUDA graphs (torch.compile's
reduce-overhead, the engine's default there), greedy tokens equal to transformers' generate in
fp32 (dense, MoE, sliding window), continuous batching and a seed that change no output, a
quantized model through the same graphs, and bf16 against fp32. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from families import tiny_family_model
from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["def add(a, b):", "import os\nclass Foo:", "x = [1, 2"]
GREEDY = SamplingParams(max_new_tokens=24)
FULL = SamplingParams(max_new_tokens=24, ignore_eos=True)  # every step runs, EOS or not


def _ids(tok, prompts=PROMPTS):
    return [tok(p)["input_ids"] for p in prompts]


def _hf_greedy(model, ids, new):
    """transformers' greedy tokens; it stops at EOS as the engine does."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _graph_launches(engine, ids) -> int:
    """cudaGraphLaunch calls while the engine decodes: proof the step replays as a CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, FULL)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)


@pytest.fixture(scope="module")
def llama(tiny_tokenizer):
    return tiny_family_model("llama", tiny_tokenizer).eval().cuda()


def test_the_step_replays_as_cuda_graphs_and_equals_hf_greedy(llama, tiny_tokenizer):
    from torch._dynamo.utils import counters

    counters.clear()
    ids = _ids(tiny_tokenizer)
    engine = Engine(llama, None, EngineConfig(max_slots=4, max_len=64))
    assert engine.compiled == "reduce-overhead"  # compile=auto on a GPU
    got = engine.generate(ids, GREEDY)
    for row, res in zip(ids, got, strict=True):
        assert res.token_ids == _hf_greedy(llama, row, GREEDY.max_new_tokens)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert _graph_launches(engine, ids) >= FULL.max_new_tokens - 1


@pytest.mark.parametrize("family", ["mixtral", "gemma2", "qwen3_moe"])
def test_moe_and_sliding_window_families_equal_hf_greedy_as_cuda_graphs(family, tiny_tokenizer):
    model = tiny_family_model(family, tiny_tokenizer).eval().cuda()
    ids = _ids(tiny_tokenizer)
    got = Engine(model, None, EngineConfig(max_slots=4, max_len=64)).generate(ids, GREEDY)
    for row, res in zip(ids, got, strict=True):
        assert res.token_ids == _hf_greedy(model, row, GREEDY.max_new_tokens), family


def test_a_request_joining_mid_flight_changes_no_output_on_the_card(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    engine = Engine(llama, None, EngineConfig(max_slots=4, max_len=64, sync_every=4))
    alone = [engine.generate([r], GREEDY)[0].token_ids for r in ids]
    first = engine.submit(ids[0], GREEDY)
    news = {first: []}
    for u in engine.step():
        news[u.request_id] += u.token_ids
    news.update({engine.submit(r, GREEDY): [] for r in ids[1:]})
    while engine.has_work():
        for u in engine.step():
            news[u.request_id] += u.token_ids
    assert list(news.values()) == alone


def test_a_seed_fixes_a_sample_on_the_card(llama, tiny_tokenizer):
    ids = _ids(tiny_tokenizer)
    sample = [
        SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=s)
        for s in (1, 2, 3)
    ]
    engine = Engine(llama, None, EngineConfig(max_slots=4, max_len=64))
    a = engine.generate(ids, sample)
    b = engine.generate(ids[::-1], sample[::-1])[::-1]
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert a[0].token_ids != engine.generate(ids[:1], GREEDY)[0].token_ids[:16]


def test_bf16_engine_stays_close_to_fp32(tiny_tokenizer):
    """The stated bf16 tolerance: read with the fp32 model (teacher-forced, so one flipped near-tie
    does not snowball), at least 90% of the bf16 engine's greedy tokens are fp32's own argmax."""
    fp32 = tiny_family_model("llama", tiny_tokenizer).eval().cuda()
    bf16 = tiny_family_model("llama", tiny_tokenizer).eval().cuda().to(torch.bfloat16)
    ids = _ids(tiny_tokenizer)
    engine = Engine(bf16, None, EngineConfig(max_slots=4, max_len=64))
    got = engine.generate(ids, FULL)
    assert engine.cache.keys[0].dtype == torch.bfloat16
    same = total = 0
    for row, res in zip(ids, got, strict=True):
        seq = torch.tensor([row + res.token_ids], device=fp32.device)
        with torch.no_grad():
            picks = fp32(seq).logits[0, len(row) - 1 : -1].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(picks, res.token_ids, strict=True))
        total += len(picks)
    assert same >= 0.9 * total, (same, total)


def test_torchao_int8_weights_decode_through_the_graphs(tiny_model_dir):
    pytest.importorskip("torchao")
    from helpers import is_quantized_layer
    from onegpu.infer import InferConfig, load

    q = load(
        InferConfig(model=str(tiny_model_dir), device="cuda", dtype="bf16", quantization="ao-int8")
    )
    assert any(is_quantized_layer(m) for m in q.model.modules())
    ids = _ids(q.tokenizer)
    engine = Engine(q.model, q.tokenizer, EngineConfig(max_slots=4, max_len=64))
    got = engine.generate(ids, FULL)
    assert all(len(r.token_ids) == FULL.max_new_tokens for r in got)
    assert _graph_launches(engine, ids) >= FULL.max_new_tokens - 1


def test_prefix_caching_and_preemption_change_no_answer_on_the_card(llama, tiny_tokenizer):
    """The paged pool on the card: a repeated prompt found in the prefix cache, and a pool far too
    small for the load preempting and recomputing, give the answers the requests get alone, the
    decode steps still replayed as CUDA graphs."""
    ids = [row * 4 for row in _ids(tiny_tokenizer)] * 2  # past a block of 16: prefixes to share
    alone = [
        Engine(llama, None, EngineConfig(max_slots=1, max_len=64)).generate([r], FULL)[0].token_ids
        for r in ids
    ]
    tight = Engine(llama, None, EngineConfig(max_slots=4, max_len=64, num_blocks=6, sync_every=4))
    assert [r.token_ids for r in tight.generate(ids, FULL)] == alone
    assert tight.stats().preemptions > 0
    roomy = Engine(llama, None, EngineConfig(max_slots=4, max_len=64))
    assert [r.token_ids for r in roomy.generate(ids, FULL)] == alone
    assert roomy.stats().prefix_hits > 0
