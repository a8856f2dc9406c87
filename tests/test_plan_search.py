"""Search keeps the effective batch, escalates only when needed, ranks by speed; the CLI prints a
table and a config that `onegpu train --config` loads."""

from __future__ import annotations

import json

import pytest

from onegpu.cli.main import main
from onegpu.config import Config, from_dict, load_yaml
from onegpu.hardware import find_gpu
from onegpu.plan import make_plan, speed
from onegpu.plan.arch import model_shape
from onegpu.plan.candidate import setup
from onegpu.plan.search import micro_batches, search, tier_candidates


@pytest.mark.parametrize("target", [1, 6, 16, 24, 64, 100])
def test_micro_batches_divide_the_effective_batch(target):
    mbs = micro_batches(target)
    assert mbs and all(target % mb == 0 for mb in mbs)
    if target % 8 == 0:
        assert all(mb % 8 == 0 or mb in (1, 2, 4) for mb in mbs)


@pytest.fixture(scope="module")
def tiny_plan():
    return search(Config(), find_gpu("T4"), model_shape("tiny"), 256, 32)


def test_search_keeps_the_effective_batch_and_ranks_by_speed(tiny_plan):
    fitting = [r for r in tiny_plan.rows if r.fits]
    assert fitting and tiny_plan.best is fitting[0]
    assert all(r.candidate.effective_batch == 32 for r in tiny_plan.rows)
    speeds = [r.speed.tokens_per_s for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.candidate.techniques.precision == "fp16" for r in fitting)  # T4: no bf16
    assert all(r.tier == 0 for r in fitting)  # a tiny model needs no memory savers


def test_search_escalates_when_nothing_fits():
    plan = search(Config(), find_gpu("T4"), model_shape("tiny"), 256, 32, capacity_gib=0.62)
    best = plan.best
    assert best is not None and best.tier > 0 and best.memory.reserved() <= 0.62 * 2**30
    assert best.candidate.effective_batch == 32
    assert any(
        not r.fits and r.tier < best.tier for r in plan.rows
    )  # what did not fit is shown too


def test_speed_model_counts_recompute_and_lora():
    shape = model_shape("tiny")
    plain, ckpt = setup(8, 1, precision="bf16"), setup(8, 1, precision="bf16", checkpointing="full")
    lora = setup(8, 1, precision="bf16", lora={"r": 8})
    f = speed.flops_per_token
    assert f(shape, ckpt, 256) > f(shape, plain, 256) > f(shape, lora, 256)
    assert f(shape, plain, 256) == pytest.approx(
        6 * shape.active_params + 12 * shape.layers * shape.hidden * 256
    )


def test_calibration_is_used_once_measured():
    spec = find_gpu("A10G")
    shape, c = model_shape("tiny"), setup(16, 1, precision="bf16")
    before = speed.estimate(shape, c, 256, spec)
    assert not before.calibrated and before.efficiency < speed.DEFAULT_EFFICIENCY
    assert any("no probe" in a for a in before.assumptions)
    speed.save_calibration("A10G", "bf16", 0.2, 16 * 256)
    after = speed.estimate(shape, c, 256, spec)
    assert after.calibrated and after.efficiency == pytest.approx(0.2 * speed._fill(spec, 16 * 256))
    assert after.tokens_per_s < before.tokens_per_s
    assert not any("no probe" in a for a in after.assumptions)


@pytest.mark.parametrize(
    "cand",
    [
        setup(16, 2, precision="bf16"),
        setup(8, 4, precision="bf16", checkpointing="full", compile="default"),
        setup(16, 1, precision="bf16", lora={"r": 16, "quantize_base": "nf4"}),
    ],
)
def test_a_probed_setup_replans_to_what_was_measured(cand, tmp_path, monkeypatch):
    """Calibration stores compute-only efficiency: re-planning a probed setup predicts the measured
    speed (the optimizer step, compile and a quantized base are not counted twice)."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # a calibration of its own
    spec, shape = find_gpu("A10G"), model_shape("tiny")
    measured = (
        0.7 * speed.estimate(shape, cand, 256, spec).tokens_per_s
    )  # a probe that found it slower
    eff = speed.compute_efficiency(shape, cand, 256, spec, measured)
    speed.save_calibration(
        "A10G", cand.techniques.precision, eff, cand.training.micro_batch_size * 256
    )
    replanned = speed.estimate(shape, cand, 256, spec)
    assert replanned.calibrated and replanned.tokens_per_s == pytest.approx(measured, rel=0.01)
    again = speed.compute_efficiency(shape, cand, 256, spec, replanned.tokens_per_s)
    assert again == pytest.approx(
        eff, rel=0.01
    )  # probing the prediction changes nothing: a fixed point
    if cand.techniques.compile != "off":
        assert any("compile" in a for a in replanned.assumptions)


def test_plan_cli_json_and_loadable_yaml(tmp_path, capsys):
    out = tmp_path / "rec.yaml"
    assert (
        main(
            [
                "plan",
                "tiny",
                "--gpu",
                "T4",
                "--data.seq_len",
                "256",
                "--batch",
                "32",
                "--json",
                "--save",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == "T4" and data["rows"][0]["fits"]
    rec = data["recommended"]
    assert rec["training"]["micro_batch_size"] * rec["training"]["grad_accum"] == 32
    cfg = from_dict(load_yaml(out))  # what `onegpu train --config` does first
    assert cfg.data.seq_len == 256 and cfg.model.name == "tiny" and cfg.plan == "off"
    # The round trip: the JSON, the saved YAML and the in-process plan say the same thing.
    from onegpu.config import to_dict

    assert to_dict(cfg) == rec
    plan, expected = make_plan(Config(), "tiny", "T4", 256, 32)
    assert to_dict(expected) == rec
    best = plan.best
    assert data["rows"][0]["plan"] == best.candidate.label()
    assert data["rows"][0]["peak_gb"] == pytest.approx(best.memory.peak / 2**30)
    assert data["rows"][0]["tokens_per_s"] == pytest.approx(best.speed.tokens_per_s)
    assert (rec["training"]["micro_batch_size"], rec["training"]["grad_accum"]) == (
        best.candidate.training.micro_batch_size,
        best.candidate.training.grad_accum,
    )
    assert len(data["rows"]) == len(plan.rows)


def test_plan_cli_table(capsys):
    """The table shows the planner's best rows in order with their own numbers, and the YAML under
    it is the recommended config."""
    import yaml

    from onegpu.config import to_dict

    assert (
        main(
            ["plan", "tiny", "--gpu", "t4", "--data.seq_len", "256", "--batch", "32", "--top", "3"]
        )
        == 0
    )
    text = capsys.readouterr().out
    cfg = Config()
    cfg.data.seq_len = 256
    plan, rec = make_plan(cfg, "tiny", "t4", None, 32)
    head, _, config_yaml = text.partition("# recommended config (onegpu train --config FILE):\n")
    lines = head.splitlines()
    shape = plan.shape
    params = f"{shape.params / 1e6:,.1f}M parameters"
    assert lines[0] == f"model tiny: {params}, {shape.layers} layers, vocab 4096"
    gib = plan.gpu.memory_gib
    assert lines[1] == f"gpu   NVIDIA Tesla T4: {gib:.1f} GB, seq_len 256, effective batch 32"
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["#", "plan", "peak"])
    assert "tokens/s (uncalibrated)" in lines[header]  # no probe has measured this GPU
    rows = [line for line in lines[header + 1 :] if line.strip()][:3]
    assert len(plan.rows) > 3 and lines[header + 4] == ""  # --top 3: three rows, then a blank line
    for n, (line, row) in enumerate(zip(rows, plan.rows, strict=False), 1):
        rank, rest = line[:2].strip(), line[4:]
        label, peak, tokens, why = (
            rest[:52].strip(),
            rest[53:61].strip(),
            rest[62:86].strip(),
            rest[88:],
        )
        assert rank == str(n) and row.fits
        assert label == row.candidate.label() and why == row.why
        assert float(peak) == round(row.memory.peak / 2**30, 2)
        assert int(tokens.replace(",", "")) == round(row.speed.tokens_per_s)
    speeds = [row.speed.tokens_per_s for row in plan.rows[:3]]
    assert speeds == sorted(speeds, reverse=True)  # fastest first
    assert yaml.safe_load(config_yaml) == to_dict(rec)
    assert rec.training.micro_batch_size * rec.training.grad_accum == 32


def test_plan_cli_errors_name_the_fix(capsys):
    assert main(["plan", "tiny", "--gpu", "h10"]) == 2
    assert "did you mean 'H100'" in capsys.readouterr().err
    assert main(["plan", "tiny", "--gpu", "T4", "--data.seq_len", "4096"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err


def test_recommended_config_applies_the_setup():
    plan, rec = make_plan(Config(), "tiny", "H100", 256, 64)
    c = plan.best.candidate
    assert (rec.training.micro_batch_size, rec.training.grad_accum) == (
        c.training.micro_batch_size,
        c.training.grad_accum,
    )
    assert rec.techniques == c.techniques


def test_configured_lora_is_kept():
    cfg = from_dict({"techniques": {"lora": {"enabled": True, "r": 8}}})
    plan = search(cfg, find_gpu("T4"), model_shape("tiny"), 256, 16)
    assert plan.best.candidate.lora_rank == 8 and plan.best.tier == 0
    rec = plan.best.candidate.apply(cfg)
    assert (
        rec.techniques.lora.enabled
        and rec.techniques.lora.r == 8
        and rec.techniques.lora.alpha == 32
    )


def test_plan_without_gpu_uses_this_cpu(capsys):
    assert main(["plan", "tiny", "--data.seq_len", "128", "--batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"] == "CPU" and data["recommended"]["techniques"]["precision"] == "fp32"


def test_optimizer_step_in_backward_is_planned_as_one_gradient_tensor():
    from onegpu.config import validate
    from onegpu.plan import memory

    shape = model_shape("tiny")
    plain, inside = (
        setup(1, 1, precision="bf16"),
        setup(1, 1, precision="bf16", optimizer_in_backward=True),
    )
    assert memory.grad_bytes(shape, plain) == shape.params * 4
    assert memory.grad_bytes(shape, inside) == shape.largest_param * 4
    # Where the optimizer step sets the peak (small activations), it holds the whole gradient copy
    # (fused AdamW: nothing else); stepped in backward, that copy never exists.
    base = memory.weight_bytes(shape, plain) + memory.optimizer_bytes(shape, plain)
    plain_peak, inside_peak = (memory.estimate(shape, c, 16).peak for c in (plain, inside))
    assert plain_peak == pytest.approx(base + shape.params * 4)
    assert inside_peak < plain_peak
    cfg = validate(inside.apply(Config()))  # what the planner recommends is a valid run
    assert cfg.techniques.optimizer_in_backward and cfg.training.max_grad_norm == 0
    assert "in-backward" in inside.label()


def test_search_offers_the_step_in_backward_only_without_accumulation():
    cfg = Config()
    plan = search(cfg, find_gpu("A100-80GB"), model_shape("tiny"), 256, 32)
    rows = tier_candidates(1, cfg, find_gpu("A100-80GB"), model_shape("tiny"), 32)
    inside = [c for c in rows if c.techniques.optimizer_in_backward]
    assert inside and all(
        c.training.grad_accum == 1 and c.techniques.offload == "none" for c in inside
    )
    assert not any(r.candidate.techniques.optimizer_in_backward for r in plan.rows if r.tier == 0)
    cfg.techniques.optimizer_in_backward, cfg.training.max_grad_norm = True, 0.0
    asked = tier_candidates(0, cfg, find_gpu("A100-80GB"), model_shape("tiny"), 32)
    assert asked and all(
        c.techniques.optimizer_in_backward and c.training.grad_accum == 1 for c in asked
    )


def test_activation_offload_is_searched_on_a_gpu_and_costs_pcie_time():
    shape, spec = model_shape("tiny"), find_gpu("A100-80GB")
    rows = tier_candidates(0, Config(), spec, shape, 32)
    assert any(c.techniques.checkpointing == "offload" for c in rows)
    full, off = (
        setup(8, 4, precision="bf16", checkpointing="full"),
        setup(8, 4, precision="bf16", checkpointing="offload"),
    )
    assert (
        speed.estimate(shape, off, 256, spec).tokens_per_s
        < speed.estimate(shape, full, 256, spec).tokens_per_s
    )
    assert any(
        "offloaded activations" in a for a in speed.estimate(shape, off, 256, spec).assumptions
    )
    from onegpu.plan import memory

    kept = {
        c.techniques.checkpointing: memory.estimate(shape, c, 256).components["activations"]
        for c in (full, off)
    }
    assert kept["offload"] < kept["full"]  # layer inputs are in host memory, not on the device


def test_the_plan_names_the_model_it_planned():
    assert model_shape("tiny").name == "tiny"  # not the name of the model's last linear layer
