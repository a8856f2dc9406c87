"""The planner's FP8 (plan/fp8.py): the layers the rule allows and the roofline keeps, the speed
of a float8 step, the search offering FP8 only where a card has FP8 tensor cores, what float8
layers keep for backward (measured: no 16-bit weight copies), and the gain `onegpu plan` prints.
The full-size memory check against MemTracker: tests/simgpu/test_fp8_memory_full_size.py."""

from __future__ import annotations

import dataclasses

import pytest

from onegpu.config import Config, TechniquesConfig
from onegpu.errors import ConfigError
from onegpu.hardware import find_gpu
from onegpu.plan import fp8, speed
from onegpu.plan.arch import model_shape
from onegpu.plan.candidate import setup
from onegpu.plan.search import tier_candidates

H100 = find_gpu("h100")


@pytest.fixture(scope="module")
def shape_1b():
    return model_shape("1b")


def _compiled(mb=4, **kw):
    return setup(mb, 2, precision="bf16", compile="default", loss_chunk_size=8192, **kw)


def test_one_layer_follows_torchaos_roofline_and_its_published_directions():
    """torchao's README measured a single compiled tensorwise Linear at 0.80x bf16 for M,K,N =
    1024,2048,1024 and 1.39x at 4096,8192,16384: the roofline puts the first below 1 and the
    second above; eager casts (torchao's ops one by one) lose at both."""
    small = fp8.layer_times(H100, "tensorwise", 1024, 2048, 1024, 2, False, eager=False)
    large = fp8.layer_times(H100, "tensorwise", 4096, 8192, 16384, 2, False, eager=False)
    assert 1 / small.ratio() < 1.0 < 1 / large.ratio()
    assert 1.2 < 1 / large.ratio() < 2.0  # FP8's peak is twice bf16's; casts take some back
    for m, k, n in ((1024, 2048, 1024), (4096, 8192, 16384)):
        assert fp8.layer_times(H100, "tensorwise", m, k, n, 2, False, eager=True).ratio() > 1.0
    # the weight gradient in high precision gains less than float8 everywhere
    hp = fp8.layer_times(H100, "rowwise-gw-hp", 4096, 8192, 16384, 2, False, eager=False)
    assert large.ratio() < hp.ratio() < 1.0


def test_the_rule_then_the_roofline_choose_the_layers(shape_1b):
    """The 1b preset at 4 x 2048 tokens on an H100: every decoder Linear is a multiple of 16; the
    GQA k/v projections (2048 -> 512) are slower in float8 (their casts outweigh the matmul), the
    rest faster."""
    names = {x[0] for x in fp8.eligible(shape_1b)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert fp8.choose_skip(shape_1b, _compiled(fp8="tensorwise"), H100, 4 * 2048) == "k_proj,v_proj"
    c = _compiled(fp8="tensorwise", fp8_skip="k_proj,v_proj")
    per_layer = 2 * 2048 * 2048 + 3 * 2048 * 8192  # q, o; gate, up, down
    assert fp8.float8_params(shape_1b, c) == 16 * per_layer
    assert fp8.float8_params(shape_1b, _compiled()) == 0


def test_a_float8_step_is_predicted_faster_compiled_and_slower_eager(shape_1b):
    c = _compiled(fp8="tensorwise", fp8_skip="k_proj,v_proj")
    bf16 = speed.estimate(shape_1b, _compiled(), 2048, H100).tokens_per_s
    ratio = speed.estimate(shape_1b, c, 2048, H100).tokens_per_s / bf16
    # the compute speeds up; the optimizer step (memory-bound) does not
    assert 1.1 < ratio < fp8.speedup(shape_1b, c, H100, 4 * 2048) < 1.6
    eager = dataclasses.replace(c, techniques=dataclasses.replace(c.techniques, compile="off"))
    plain = dataclasses.replace(eager, techniques=dataclasses.replace(eager.techniques, fp8="off"))
    assert (
        speed.estimate(shape_1b, eager, 2048, H100).tokens_per_s
        < speed.estimate(shape_1b, plain, 2048, H100).tokens_per_s
    )
    assert fp8.ASSUMED in speed.estimate(shape_1b, c, 2048, H100).assumptions


def test_a_probe_of_a_float8_setup_replans_to_what_it_measured(shape_1b, tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    c = _compiled(fp8="tensorwise", fp8_skip="k_proj,v_proj")
    eff = speed.compute_efficiency(shape_1b, c, 2048, H100, 90_000.0)
    speed.save_calibration(H100.key, "bf16", eff, 4 * 2048)
    assert speed.estimate(shape_1b, c, 2048, H100).tokens_per_s == pytest.approx(90_000.0)


def test_search_offers_fp8_on_fp8_cards_only(shape_1b):
    """Left to auto, a card with FP8 tensor cores gets each setup with and without float8 layers,
    their layers chosen at the setup's own micro-batch (fewer tokens: fewer layers gain)."""

    def fp8_settings(gpu, **techniques):
        cfg = Config(techniques=TechniquesConfig(precision="bf16", compile="default", **techniques))
        cands = tier_candidates(0, cfg, find_gpu(gpu), shape_1b, 8, 2048)
        return {
            (c.training.micro_batch_size, c.techniques.fp8, c.techniques.fp8_skip) for c in cands
        }

    h100 = fp8_settings("h100")
    assert {(8, "off", ""), (8, "tensorwise", "k_proj,v_proj")} <= h100
    assert (1, "tensorwise", "k_proj,o_proj,q_proj,v_proj") in h100  # 2048 tokens a call
    assert {s[1] for s in fp8_settings("l40s")} == {"off", "tensorwise"}
    assert {s[1:] for s in fp8_settings("a100")} == {("off", "")}  # no FP8 tensor cores
    assert {s[1:] for s in fp8_settings("h100", fp8="off")} == {("off", "")}
    fixed = fp8_settings("h100", fp8="rowwise", fp8_skip="q_proj")
    assert {s[1:] for s in fixed} == {("rowwise", "q_proj")}  # the user's layers are kept
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        fp8_settings("a100", fp8="tensorwise")


def test_float8_layers_keep_no_16bit_weight_copies():
    """Measured (plan/activations.py, the measuring model built with float8 layers): under bf16
    autocast a plain Linear saves a 16-bit copy of its weight for its input gradient, a float8 one
    saves its fp32 weight itself; the difference per block is 2 bytes a weight, whatever the
    batch (the fit's constant term)."""
    from transformers import LlamaConfig

    from onegpu.plan.activations import activation_model

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
    weights = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512  # q, o; k, v; gate, up, down
    t = TechniquesConfig(precision="bf16", compile="off", loss="plain")
    plain = activation_model(config, t, "sdpa")
    float8 = activation_model(config, dataclasses.replace(t, fp8="tensorwise"), "sdpa")
    assert plain.block.const - float8.block.const == pytest.approx(2 * weights, rel=0.01)
    assert plain.block.linear == pytest.approx(float8.block.linear, rel=0.01)  # inputs kept alike
    assert float8.block_compiled.linear < plain.block_compiled.linear  # casts recomputed instead


def test_autocasts_cache_holds_no_float8_layer_weight(shape_1b):
    from onegpu.plan.autocast_cache import cached_cast_bytes

    ckpt = {"checkpointing": "full", "precision": "bf16"}
    plain, c = setup(2, **ckpt), setup(2, fp8="tensorwise", fp8_skip="k_proj,v_proj", **ckpt)
    assert cached_cast_bytes(shape_1b, plain) - cached_cast_bytes(shape_1b, c) == (
        2 * fp8.float8_params(shape_1b, c)
    )


def test_the_gain_line_says_what_the_plan_did():
    from types import SimpleNamespace as NS

    shape = model_shape("1b")
    c = _compiled(fp8="tensorwise", fp8_skip="k_proj,v_proj")
    twin = dataclasses.replace(c, techniques=dataclasses.replace(c.techniques, fp8="off"))
    twin = dataclasses.replace(twin, techniques=dataclasses.replace(twin.techniques, fp8_skip=""))

    def row(cand, tokens, peak):
        return NS(candidate=cand, fits=True, speed=NS(tokens_per_s=tokens), memory=NS(peak=peak))

    g = fp8.gain([row(c, 130.0, 8.0), row(twin, 100.0, 10.0)], H100, shape)
    assert g["ratio"] == pytest.approx(1.3) and g["chosen"] and g["memory_ratio"] == 0.8
    assert (g["float8_layers"], g["linear_layers"]) == (80, 112)
    line = fp8.gain_line(g, H100)
    assert "1.30x the tokens/s" in line and "k_proj,v_proj" in line and line.endswith("chosen")
    assert not fp8.gain([row(twin, 140.0, 10.0), row(c, 130.0, 8.0)], H100, shape)["chosen"]
    assert "no FP8 tensor cores" in fp8.gain_line(None, find_gpu("a100"))
