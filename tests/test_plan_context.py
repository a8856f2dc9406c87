"""The planner for long context and the largest model: activation offload and tiled MLP in the
memory and speed models, the memory options crossed in one tier, the longest sequence per setup
(`onegpu plan --max-context`), and torchtune's and Unsloth's published figures."""

from __future__ import annotations

import re

import pytest

import torchtune_rows
from onegpu.cli.main import main
from onegpu.config import Config
from onegpu.hardware import find_gpu
from onegpu.plan import memory, published, speed
from onegpu.plan.arch import model_shape
from onegpu.plan.candidate import setup
from onegpu.plan.context import ladder, longest
from onegpu.plan.search import tier_candidates

GIB = 2**30


def test_tier_one_crosses_bf16_weights_8bit_and_paged_state_step_in_backward_and_offload():
    rows = tier_candidates(1, Config(), find_gpu("RTX4090"), model_shape("tiny"), 2, 256)
    seen = {
        (
            c.techniques.precision,
            c.techniques.optimizer,
            c.techniques.optimizer_in_backward,
            c.techniques.activation_offload,
        )
        for c in rows
    }
    for opt in ("adamw-8bit", "paged-adamw-8bit"):
        assert ("bf16-pure", opt, True, True) in seen and (
            "bf16",
            opt,
            True,
            False,
        ) in seen
    assert ("bf16-pure", "adamw", False, False) in seen  # bf16 weights alone
    assert (
        "bf16",
        "adamw",
        False,
        False,
    ) not in seen  # tier 0's setup, not offered twice
    assert not any(
        c.techniques.activation_offload and c.techniques.checkpointing == "offload" for c in rows
    )


def test_activation_offload_moves_the_blocks_to_pinned_host_memory():
    shape = model_shape("1b")
    for ckpt in ("off", "full"):
        plain = setup(2, 1, precision="bf16", checkpointing=ckpt)
        off = setup(2, 1, precision="bf16", checkpointing=ckpt, activation_offload=True)
        a, b = memory.estimate(shape, plain, 2048), memory.estimate(shape, off, 2048)
        host = memory.activations(shape, off, 2048)[2]
        blocks = memory.activation_model(shape.config, plain.techniques).blocks(
            2, 2048, shape.layers, ckpt
        )
        assert host == pytest.approx(blocks) and b.host_activations == host > 0
        # what stays on the device: the rest, and the copies in flight (4 of the largest storage)
        storage = memory.largest_saved(shape, off, 4096, False, ckpt == "full")
        kept_plain, kept_off = (memory.activations(shape, x, 2048)[0] for x in (plain, off))
        assert kept_off == pytest.approx(kept_plain - host + 4 * storage)
        assert b.peak <= a.peak
        assert "offloaded activations (pinned host)" in b.components


def test_activation_offload_costs_only_the_copy_time_compute_does_not_hide():
    shape, c = (
        model_shape("1b"),
        setup(2, 1, precision="bf16", checkpointing="full", activation_offload=True),
    )
    moved = memory.estimate(shape, c, 2048).host_activations
    gpu = find_gpu("RTX4090")
    assert (
        speed.pcie_gbs(gpu) == pytest.approx(31.5 * 0.8)
        and speed.pcie_gbs(find_gpu("H100")) == 63 * 0.8
    )
    copy = moved / (speed.pcie_gbs(gpu) * 1e9)
    assert speed.offload_exposed_seconds(c, gpu, compute=3 * copy, offloaded=moved) == 0  # hidden
    assert speed.offload_exposed_seconds(c, gpu, compute=0.0, offloaded=moved) == pytest.approx(
        2 * copy
    )
    assert any(
        "activation offload at 25 GB/s" in a
        for a in speed.estimate(shape, c, 2048, gpu).assumptions
    )


def test_tiled_mlp_drops_the_mlp_intermediates_and_pays_one_more_mlp_forward():
    shape = model_shape("1b")
    plain = setup(1, 1, precision="bf16", tiled_mlp="off")
    tiled = setup(1, 1, precision="bf16", tiled_mlp="on")
    seq = 8192
    drop = (
        memory.estimate(shape, plain, seq).components["activations"]
        - memory.estimate(shape, tiled, seq).components["activations"]
    )
    assert drop == pytest.approx(
        shape.layers * 4 * seq * shape.intermediate * 2
    )  # gate, up, act, product
    extra = speed.flops_per_token(shape, tiled, seq) - speed.flops_per_token(shape, plain, seq)
    assert extra == 6 * shape.hidden * shape.intermediate * shape.layers
    auto = setup(1, 1, precision="bf16")  # tiled_mlp=auto: from tiled_mlp_min_seq tokens
    assert not memory.mlp_tiled(shape, auto, 4096) and memory.mlp_tiled(shape, auto, 8192)


def test_max_context_bisects_to_the_last_length_that_fits(capsys):
    spec, shape, gib = find_gpu("RTX4090"), model_shape("small"), 2.0
    rows = ladder(Config(), spec, shape)
    assert [label for label, _ in rows][-1] == "+ activation offload"
    lengths = []
    for _, c in rows:
        n = longest(shape, c, spec, gib * GIB)
        assert memory.estimate(shape, c, n).fits(gib * GIB) and not memory.estimate(
            shape, c, n + 1
        ).fits(gib * GIB)
        lengths.append(n)
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]  # each technique adds length
    assert (
        main(
            [
                "plan",
                "small",
                "--gpu",
                "RTX4090",
                "--memory_gib",
                str(gib),
                "--max-context",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for (label, _), n in zip(rows, lengths, strict=True):
        assert re.search(re.escape(label) + rf"\s+{n:,}\s", out), label


def test_unsloths_figures_are_matched_to_the_same_model_method_and_card():
    from transformers import LlamaConfig

    cfg = Config()
    (
        cfg.techniques.lora.enabled,
        cfg.techniques.lora.r,
        cfg.techniques.lora.quantize_base,
    ) = True, 32, "nf4"
    llama8b = LlamaConfig(**published.LLAMA_3_1_8B)
    assert published.published_context(llama8b, 23.5, cfg.techniques.lora).tokens == 78_475
    assert published.published_context(llama8b, 79.2, cfg.techniques.lora).baseline_tokens == 28_454
    cfg.techniques.lora.r = 16
    assert published.published_context(llama8b, 79.2, cfg.techniques.lora) is None


@pytest.mark.slow
def test_llama_8b_full_fine_tune_on_a_4090_is_found_within_10_percent_of_torchtune():
    """torchtune: 18.9 GiB peak, bf16 weights, paged 8-bit AdamW with the step in backward,
    activation checkpointing, chunked cross-entropy; batch 2 x 2048 on one RTX 4090."""
    row = torchtune_rows.predict_8b_4090()
    assert row["found"], (
        f"torchtune's setup is not among the fitting rows; the plan picked {row['best']}"
    )
    assert row["predicted_gib"] == pytest.approx(18.9, rel=0.10), row
    assert "paged optimizer state (host-backed)" in row["components_gib"]  # not in the device peak
    assert "lora" not in row["best"]  # a full fine-tune fits: no fallback to adapters


EIGHT_BIT_GAP = (
    "predicted 15.4 GiB of 17.6 (0.88): torchtune's row drops 4.2 GiB where the 8-bit state "
    "explains 5.9; on an H100 (2026-11-25, 1b preset, 2 x 4096) bitsandbytes' AdamW8bit took 5.50 "
    "GiB less than AdamW with and without the step in backward, the modelled state difference "
    "(5.50), so the 1.7 GiB is outside the state; bf16 weights have no autocast copies "
    "(plan/autocast_cache.py); not found without a run of torchtune's recipe (docs/planner.md)"
)


@pytest.mark.parametrize(
    "key",
    [
        "in_bwd",
        "offload",
        pytest.param("adamw8bit", marks=pytest.mark.xfail(strict=True, reason=EIGHT_BIT_GAP)),
        "lora",
        "qlora",
    ],
)
@pytest.mark.slow
def test_torchtune_3b_ladder_rows_within_10_percent(key):
    row = torchtune_rows.predict([key])["rows"][0]
    assert row["predicted_gib"] == pytest.approx(row["published_gib"], rel=0.10), row
