"""FP8 training on the card's fake "cuda" tensors: on a card with FP8 tensor cores (H100, RTX 4090)
a step through training's own prepare_model and train_step, under CUDA autocast, runs torchao's
float8 layers on the card's own kernel (``aten._scaled_mm``, its fake implementation: shapes and
dtypes); on one without (A100, T4) the start is refused with the card's name. Runs inside a card's
process."""

from __future__ import annotations

import pytest
import torch
from card_step import step

from onegpu.config import TechniquesConfig
from onegpu.hardware import detect

FP8_CARDS = ("H100", "RTX4090")


def test_fp8_step_runs_the_cards_float8_kernel(card):
    if card.key not in FP8_CARDS:
        pytest.skip("no FP8 tensor cores: test_fp8_is_refused_by_name")
    from torch.profiler import ProfilerActivity, profile
    from torchao.float8.float8_linear import Float8Linear

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model, opt, acc, loss = step(TechniquesConfig(precision="bf16", fp8="tensorwise"))
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 2 * 7  # every decoder Linear of the tiny model; the head stays
    assert acc.mixed_precision == "bf16" and loss.device.type == "cuda"
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")
    # output, input gradient, weight gradient of each layer at least (the profiler also records
    # the fake kernel's own nested dispatches); none without float8 layers
    assert calls >= 3 * len(layers)
    assert next(model.parameters()).dtype == torch.float32  # the weights stay the run's
    with profile(activities=[ProfilerActivity.CPU]) as plain:
        step(TechniquesConfig(precision="bf16", fp8="off"))
    assert not any(e.key == "aten::_scaled_mm" for e in plain.key_averages())


def test_fp8_is_refused_by_name(card):
    if card.key in FP8_CARDS:
        pytest.skip("this card has FP8 tensor cores")
    from onegpu.errors import UnavailableError
    from onegpu.techniques.precision import resolve_precision

    device = detect()
    with pytest.raises(UnavailableError, match=card.name) as err:
        resolve_precision(TechniquesConfig(fp8="tensorwise"), device)
    assert "FP8 tensor cores" in str(err.value) and "fp8_emulate" in err.value.hint
