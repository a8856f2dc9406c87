"""The decode engine on the card's fake "cuda" tensors: the CUDA branches a GPU run takes (the KV
pool, the rows' state at fixed addresses, the block tables copied up from the
host, the step compiled as CUDA graphs), prompt pieces written into the pool — a later one reading
the blocks of a cached prefix through its block table — the paged decode step of every row, a
grammar's token mask copied up from the host and applied on the card, and a sequence's row state
moved to a lower row (the scheduler's compaction). Runs inside a card's process.

What cannot run here, and why: the CUDA-graph capture itself (torch.compile's reduce-overhead under
fake tensors: nothing to record), with it the server's warm-up on a GPU (``DecodeStep.warm_up``
runs each bucket twice there, as cudagraph trees record a graph at its second call), and the
read-back of tokens (a fake tensor has no values) — they run on a real card in
`scripts/gpu_check.sh`'s engine and infer steps (the server's warm-up: `serve_warm_start.py`, at
commit e14f338)."""

from __future__ import annotations

import cards
import pytest
import torch
from card_step import VOCAB, _model

from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.prefill import prefill
from onegpu.infer.requests import SamplingParams
from onegpu.infer.sampling import Needs
from onegpu.infer.scheduler import Plan


def _run_pieces(engine):
    """One engine step up to its read-back: the plan, the pool's blocks zeroed, the plan applied
    to the rows (settings and tables up), the pieces through the runner and their first tokens
    through the sampler."""
    plan = engine.scheduler.schedule()
    engine.cache.reserve(engine.pool.high_water)
    assert engine.rows.apply(plan) == {}
    firsts = prefill(engine.runner, engine.rows, list(plan.pieces), engine._names, {}).firsts
    for piece in plan.pieces:  # what the read-back would tell the scheduler
        if piece.last:  # a fake tensor has no value: the first token read back as token 0
            engine.scheduler.extend(piece.seq, [0])  # its first token: decoding starts
        else:
            engine.scheduler.computed(piece.seq, piece.end)
    return plan, firsts


def test_the_engine_computes_pieces_and_steps_every_row_on_the_card(card):
    if card.key != "H100":
        pytest.skip("the engine does not branch on which card runs it: the H100 runs it")
    model = _model()
    prefix = list(range(3, 35))  # two full blocks, cached by the first request
    with cards.fake_cuda():
        cards.on_card(model).eval()
        engine = Engine(model, None, EngineConfig(max_slots=2, max_len=64, token_budget=24))
        assert engine.compiled == "reduce-overhead"  # compile=auto on a GPU: CUDA graphs
        sample = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=8, top_p=0.9, seed=1)
        engine.submit(prefix + [40], sample)
        with torch.no_grad():
            first, _ = _run_pieces(engine)  # 24 of its 33 tokens: a piece that ends a chunk
            second, firsts = _run_pieces(engine)  # the rest; its first token sampled
            engine.submit(
                prefix + [41, 42],
                SamplingParams(
                    max_new_tokens=4, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=2
                ),
            )
            third, more = _run_pieces(engine)  # reads the cached prefix through its table
            every = Needs(True, True, True, penalties=True, logprobs=True)
            nxt, logprobs = engine.decode_step.step(2, 64, every, None)  # the eager twin
            # a grammar's mask: written on the host, copied up, applied on the device
            bits = torch.zeros(engine.rows.bitmask.shape[1], dtype=torch.int32)
            bits[0] = 0b1000  # token 3 alone
            engine.rows.set_masks({0: bits})
            # every row's mask applied, as the compiled step applies it (finding the masked rows
            # would wait for the device: a fake tensor has no values to find them by)
            masked, _ = engine.decode_step.step(2, 64, Needs(constraints=True), None)
            # a sequence moves down a row (the scheduler compacts them): its state on the card
            engine.rows.apply(Plan(moved=((1, 0),)))
    assert [(p.start, p.end) for p in first.pieces + second.pieces] == [(0, 24), (24, 33)]
    assert [(p.start, p.end) for p in third.pieces] == [(32, 34)]  # 32 found in the cache
    assert engine.stats().prefix_hits == 32 and len(firsts) == len(more) == 1
    assert nxt.is_cuda and nxt.shape == (2,) and masked.is_cuda and masked.shape == (2,)
    assert engine.rows.bitmask.is_cuda and engine.rows.host_bitmask.device.type == "cpu"
    assert engine.rows.tokens.is_cuda and engine.rows.counts.is_cuda
    assert all(t.is_cuda for t in logprobs) and logprobs[1].shape == (2, engine.rows.top)
    assert engine.rows.counts.is_cuda and engine.rows.top_ids.is_cuda
    blocks = engine.pool.num_blocks * engine.pool.block_size
    assert all(k.is_cuda and k.shape[1] == blocks for k in engine.cache.keys)
    assert engine.rows.tables.is_cuda and engine.rows.seen.shape == (2, VOCAB)


def test_batched_lora_stacks_the_adapters_on_the_card_at_fixed_addresses(card):
    """Two LoRA adapters of different ranks stacked on the card at fixed addresses (a CUDA graph
    reads them where they lie) and the rows routed by index (batched_lora.py's CUDA branch)."""
    if card.key != "H100":
        pytest.skip("the engine does not branch on which card runs it: the H100 runs it")
    from peft import LoraConfig, get_peft_model

    from onegpu.infer.batched_lora import BatchedLora

    model = _model()
    with cards.fake_cuda():
        model = cards.on_card(model).eval()
        lora = {"target_modules": ["q_proj", "v_proj"], "lora_alpha": 8}
        model = get_peft_model(model, LoraConfig(r=4, **lora), adapter_name="a")
        model.add_adapter("b", LoraConfig(r=8, **lora))
        index = torch.zeros(2, dtype=torch.long, device="cuda")
        batched = BatchedLora.of(model, index)
        assert batched.route(["a", "__base__"])
        stack = batched.layers[0][1]
    assert stack.a.is_cuda and stack.a.shape[:2] == (3, 8) and stack.slots.is_cuda
    assert len(batched.layers) == 4  # q and v of both layers
