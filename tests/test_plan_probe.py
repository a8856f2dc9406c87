"""`train --plan auto` on CPU: probes the predicted best setups, trains with the fastest measured,
keeps the effective batch, and stores the measured efficiency for later plans."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
import yaml

from onegpu.config import from_dict
from onegpu.plan import probe, speed
from onegpu.plan.arch import model_shape
from onegpu.plan.candidate import Candidate


def _cfg(tiny_model_dir, text_file, tmp_path, **training):
    t = {
        "micro_batch_size": 4,
        "grad_accum": 2,
        "max_steps": 2,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "warmup_steps": 0,
    }
    t.update(training)
    return from_dict(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"path": str(text_file), "seq_len": 64, "num_proc": 1},
            "training": t,
            "output": {"dir": str(tmp_path / "runs"), "report_to": "none"},
            "plan": "auto",
        }
    )


@pytest.mark.slow
def test_train_plan_auto_probes_then_trains(tiny_model_dir, text_file, tmp_path, caplog):
    from onegpu import train

    caplog.set_level(logging.INFO, logger="onegpu.plan.probe")
    result = train(_cfg(tiny_model_dir, text_file, tmp_path))
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    t = saved["training"]
    assert t["micro_batch_size"] * t["grad_accum"] == 8  # the effective batch survives the plan
    assert saved["plan"] == "off" and result.state.step == 2
    text = caplog.text
    assert "predicted vs measured" in text and "training with" in text
    calib = json.loads(speed.calibration_path().read_text())
    # The stored efficiency is the chosen probe's measured speed turned back into compute-only
    # efficiency: recompute it from the logged measurement and the chosen setup.
    measured = float(
        re.search(r"training with .+ \(([\d,]+) tokens/s measured\)", text)
        .group(1)
        .replace(",", "")
    )
    trained = from_dict(saved)
    chosen = Candidate(trained.training, trained.techniques, trained.preference)
    shape = model_shape(str(tiny_model_dir))
    spec = speed_spec()
    expected = speed.compute_efficiency(shape, chosen, 64, spec, measured)
    stored = calib["CPU"]["fp32"]["efficiency"]
    assert stored == pytest.approx(expected, rel=0.01) and stored != speed.DEFAULT_EFFICIENCY
    # ... so that re-planning the chosen setup predicts what the probe measured.
    assert speed.estimate(shape, chosen, 64, spec).tokens_per_s == pytest.approx(measured, rel=0.01)
    assert calib["CPU"]["fp32"]["tokens_per_micro"] == t["micro_batch_size"] * 64
    eff, calibrated = speed.base_efficiency(spec, "fp32")
    assert calibrated and eff != speed.DEFAULT_EFFICIENCY  # later plans use the measurement


def speed_spec():
    from onegpu import hardware

    return hardware.spec_from_device(hardware.detect())


def test_auto_plan_skips_setups_that_fail(tiny_model_dir, text_file, tmp_path, monkeypatch):
    calls = []

    def fake_run(cfg, shared, device):
        calls.append((cfg.training.micro_batch_size, cfg.training.grad_accum))
        if len(calls) == 2:  # the first timed probe (the call before it is the untimed warm-up)
            raise torch.OutOfMemoryError("probe OOM")
        return 100.0 * len(calls), 0.1

    monkeypatch.setattr(probe, "_run_steps", fake_run)
    cfg = _cfg(tiny_model_dir, text_file, tmp_path, micro_batch_size=8, grad_accum=2)
    out = probe.auto_plan(cfg)
    assert (
        len(calls) == probe.TOP + 1 and calls[0] == calls[1]
    )  # a warm-up pass, then the top predictions
    chosen = (out.training.micro_batch_size, out.training.grad_accum)
    assert chosen == calls[-1] and chosen != calls[1]  # fastest measured among those that ran
    assert out.training.micro_batch_size * out.training.grad_accum == 16 and out.plan == "off"


def test_uncatalogued_gpu_gets_a_logged_stand_in(caplog):
    from onegpu.hardware import DeviceInfo

    caplog.set_level(logging.WARNING, logger="onegpu.plan.probe")
    spec = probe._device_spec(DeviceInfo("cuda", "Mystery GPU", 20 * 2**30, (8, 6)))
    assert spec.key == "Mystery GPU" and spec.memory_gib == 20 and spec.capability <= (8, 6)
    assert "not in the GPU catalog" in caplog.text
