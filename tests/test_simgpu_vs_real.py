"""scripts/simgpu_vs_real.py: its simulated side runs without a card, and the reason it cannot go
through plan/accuracy's build (what crashed it on the H100) holds on the CPU too."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import benchmark_script
from onegpu.plan.candidate import setup as candidate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_accelerator():
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _config():
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )


def test_fake_weights_placed_by_accelerate_cannot_be_swapped():
    """The card's crash, on the CPU: plan/accuracy's build under a FakeTensorMode lets Accelerate
    place the model; torch moves a fake parameter by swapping it, and swap_tensors refuses one the
    fake mode holds a weak reference to."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from onegpu.plan import accuracy

    c = candidate(2, 1, precision="fp32", checkpointing="off")
    with pytest.raises(RuntimeError, match=r"Couldn't swap Embedding\.weight") as err:
        with FakeTensorMode(allow_non_fake_inputs=True), MemTracker():
            accuracy.build(_config(), c)
    assert "weakref" in str(err.value.__cause__)


@pytest.mark.parametrize("ckpt", ["off", "full"])
def test_simulated_peak_is_measured_without_a_card(ckpt):
    """The script's simulated side (the tier's harness: fake weights left where they are) gives a
    step's peak: at least weights, gradients and AdamW's two moments, fp32."""
    script = benchmark_script("simgpu_vs_real", folder="scripts")
    config = _config()
    c = candidate(2, 1, precision="bf16", checkpointing=ckpt)
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    peak = script.simulated_peak(config, c, 64)
    assert peak >= 4 * params * torch.float32.itemsize
