"""Every decision that depends on the card, against what a user of that card must get.

Runs inside a card's process (test_cards.py); ``card`` is the simulated card."""

from __future__ import annotations

import logging

import pytest
import torch

from onegpu.config import Config, TechniquesConfig
from onegpu.hardware import detect, match_device

# What a user of each card must get: precision=auto, TF32 default, the tensor-core multiple the
# shape advice asks for in that precision, the planner's catalogue entry.
EXPECTED = {
    "H100": ("bf16", True, 64, "H100"),
    "RTX4090": ("bf16", True, 64, "RTX4090"),
    "A100": ("bf16", True, 64, "A100-80GB"),
    "T4": ("fp16", False, 8, "T4"),
}


def test_detected_device_is_the_card(card):
    d = detect()
    assert (d.type, d.name, d.total_memory, d.capability) == (
        "cuda",
        card.name,
        card.total_memory,
        card.capability,
    )
    assert d.bf16 == card.bf16 and d.tf32 == card.bf16


def test_precision_auto_and_bf16_refusal(card):
    from onegpu.errors import UnavailableError
    from onegpu.techniques.precision import resolve_precision

    assert resolve_precision(TechniquesConfig(), detect()) == EXPECTED[card.key][0]
    if card.bf16:
        assert resolve_precision(TechniquesConfig(precision="bf16"), detect()) == "bf16"
    else:
        with pytest.raises(UnavailableError, match="capability 7.5"):
            resolve_precision(TechniquesConfig(precision="bf16"), detect())


def test_tf32_default_sets_the_cuda_backends(card):
    from onegpu.techniques.prepare import global_switches

    before = torch.backends.cuda.matmul.fp32_precision
    with global_switches(Config(), detect()):
        want = "tf32" if EXPECTED[card.key][1] else "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == want
        assert torch.backends.cudnn.conv.fp32_precision == want
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_shape_advice_multiple(card, caplog):
    from onegpu.techniques.precision import resolve_precision
    from onegpu.training.startup import check_shapes, preferred_multiple

    precision = resolve_precision(TechniquesConfig(), detect())
    want = EXPECTED[card.key][2]
    assert preferred_multiple(precision, detect()) == want
    with caplog.at_level(logging.WARNING):
        found = check_shapes(8, 1004, 4096, precision, detect())
    assert len(found) == 1 and f"data.seq_len=1004 is not a multiple of {want}" in found[0]


def test_catalogue_match(card):
    from onegpu.hardware import spec_from_device

    spec = match_device(detect())
    assert spec is not None and spec.key == EXPECTED[card.key][3]
    assert spec.capability == card.capability and spec.has_bf16 == card.bf16
    assert abs(spec.memory_gib - card.total_memory / 2**30) < 1.5
    assert spec_from_device(detect()) is spec


def test_attention_auto_and_flash(card):
    from onegpu.techniques.attention import (
        SDPA_FLASH,
        flash_attn_installed,
        resolve_attention,
    )

    precision = "bf16" if card.bf16 else "fp16"
    auto = resolve_attention(TechniquesConfig(), detect(), precision)
    assert auto == ("flash_attention_2" if flash_attn_installed() else "sdpa")
    flash = resolve_attention(TechniquesConfig(attention="flash"), detect(), precision)
    assert flash == ("flash_attention_2" if flash_attn_installed() else SDPA_FLASH)


def test_compile_auto(card):
    import importlib.util

    from onegpu.techniques.compile import resolve_compile

    cfg = Config()
    cfg.training.max_steps = 1000
    # On a GPU, compile=auto compiles with inductor when triton (its GPU code generator) exists.
    want = "default" if importlib.util.find_spec("triton") else "off"
    assert resolve_compile(cfg, detect().type) == want
    cfg.training.max_steps = 10
    assert resolve_compile(cfg, detect().type) == "off"


def test_pinned_memory_and_non_blocking_copies(card):
    """The loader pins batches on a GPU (the page-locking kernel itself is CUDA's: not run here),
    and training's non-blocking copy puts them on the card."""
    import cards

    from onegpu.config.sections import DataConfig
    from onegpu.data.batches import make_loader

    class Rows(list):
        def with_format(self, _):
            return self

    rows = Rows([torch.arange(4)] * 4)
    loader = make_loader(rows, [[0, 1], [2, 3]], torch.stack, DataConfig(), on_gpu=detect().is_gpu)
    assert loader.pin_memory
    with cards.fake_cuda():
        moved = torch.stack(list(rows[:2])).to("cuda", non_blocking=True)
    assert moved.device.type == "cuda" and moved.shape == (2, 4)


def test_fused_adamw_on_card_parameters(card):
    import cards

    from onegpu.config.sections import TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    model = torch.nn.Linear(16, 16, device="meta")  # built outside the fake mode, moved inside it
    with cards.fake_cuda():
        cards.on_card(model)
        opt = build_optimizer(model, TechniquesConfig(optimizer="adamw"), TrainingConfig())
        assert opt.defaults["fused"] is True
        model(torch.ones(2, 16, device="cuda")).sum().backward()
        opt.step()  # the fused CUDA kernel's fake: the step counter stays on the card
        assert opt.state[model.weight]["step"].device.type == "cuda"
        foreach = build_optimizer(
            model, TechniquesConfig(optimizer="adamw-foreach"), TrainingConfig()
        )
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]


def test_paged_optimizer_is_paged_on_a_gpu(card, caplog):
    """The optimizer is built before the model moves to the card: it must still be the paged one,
    and must not say it runs as plain adamw-8bit."""
    from onegpu.config.sections import TrainingConfig
    from onegpu.techniques.optimizers import build_optimizer

    model = torch.nn.Linear(64, 64)  # still on the CPU, as in training's assembly
    with caplog.at_level(logging.INFO):
        opt = build_optimizer(
            model, TechniquesConfig(optimizer="paged-adamw-8bit"), TrainingConfig()
        )
    assert type(opt).__name__ == "PagedAdamW8bit" and opt.is_paged
    assert "runs as adamw-8bit" not in caplog.text
    # and the plan for this card counts its state as host-backed, outside the device's peak
    from onegpu.hardware import detect
    from onegpu.plan import memory
    from onegpu.plan.arch import model_shape
    from onegpu.plan.candidate import setup

    shape, on_gpu = model_shape("1b"), detect().is_gpu
    paged, plain = (
        memory.estimate(shape, setup(1, 1, optimizer=o), 1024, on_gpu=on_gpu)
        for o in ("paged-adamw-8bit", "adamw-8bit")
    )
    state = memory.state_bytes(shape, setup(1, 1, optimizer="adamw-8bit"))
    assert paged.components["paged optimizer state (host-backed)"] == state
    assert paged.peak == pytest.approx(plain.peak - state)


def test_doctor_report(card):
    from onegpu.cli import doctor

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "shutil.which",
            lambda name: None if name == "nvidia-smi" else "/usr/bin/" + name,
        )
        assert doctor.driver_version() == "CUDA driver API 12.8"
    gpu = doctor.gpu_info()
    assert gpu == {
        "name": card.name,
        "capability": "{}.{}".format(*card.capability),
        "memory_gib": round(card.total_memory / 2**30, 1),
        "count": 1,
    }
    checks = {c.name: c for c in doctor.check_precision()}
    assert checks["bf16"].ok == card.bf16 and checks["tf32"].ok == card.bf16
    if not card.bf16:
        assert "precision=fp16" in checks["bf16"].hint


def test_unknown_card_is_named_in_the_refusal(card):
    """A card missing from the catalogue gets no guessed speed: the planner says which card."""
    from onegpu.errors import UnavailableError
    from onegpu.hardware import DeviceInfo, spec_from_device

    other = DeviceInfo("cuda", "NVIDIA Quadro Imaginary 9000", card.total_memory, card.capability)
    assert match_device(other) is None
    with pytest.raises(UnavailableError, match="Quadro Imaginary 9000"):
        spec_from_device(other)


def test_matmul_peak_is_measured_in_bf16_on_the_card(card):
    import cards

    from onegpu.hardware import measure_matmul_flops

    n = 8192
    with cards.fake_cuda():
        cards.MEMORY.reset_peak()
        held = cards.MEMORY.allocated()
        assert measure_matmul_flops("cuda", seconds=0.01) > 0
        # on the card, in bf16: the two n x n operands and one product at a time, 2 bytes each
        assert cards.MEMORY.peak - held == 3 * n * n * torch.bfloat16.itemsize
