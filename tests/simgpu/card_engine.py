"""The decode engine on the card's fake "cuda" tensors: the CUDA branches a GPU run takes (the KV
cache and the slots' state at fixed addresses, the step compiled as CUDA graphs), a prefill into
each slot and a decode step of all slots. Runs inside a card's process.

What cannot run here, and why: the CUDA-graph capture itself (torch.compile's reduce-overhead under
fake tensors: nothing to record) and the read-back of tokens (a fake tensor has no values) — both
run on a real card in `scripts/gpu_check.sh`'s infer step."""

from __future__ import annotations

import cards
import pytest
import torch
from card_step import VOCAB, _model

from onegpu.infer.engine import Engine, EngineConfig
from onegpu.infer.requests import SamplingParams


def test_the_engine_prefills_and_steps_every_slot_on_the_card(card):
    if card.key != "H100":
        pytest.skip("the engine does not branch on which card runs it: the H100 runs it")
    model = _model()
    with cards.fake_cuda():
        cards.on_card(model).eval()
        engine = Engine(model, None, EngineConfig(max_slots=2, max_len=32))
        assert engine.compiled == "reduce-overhead"  # compile=auto on a GPU: CUDA graphs
        sample = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=8, top_p=0.9, seed=1)
        engine.submit([1, 2, 3], sample)
        engine.submit([4, 5], SamplingParams(max_new_tokens=4, repetition_penalty=1.2))
        with torch.no_grad():
            engine._admit()  # a prefill into each slot and its first token, on the card
            nxt = engine.stepper.step(2, 32, (True, True, True), None)  # the eager twin
    assert nxt.is_cuda and nxt.shape == (2,)
    assert all(k.is_cuda and k.shape[:3] == (2, 2, 32) for k in engine.cache.keys)
    assert engine.state.seen.shape == (2, VOCAB) and engine.state.positions.is_cuda
