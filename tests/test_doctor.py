"""`onegpu doctor` runs on a CPU-only machine, reports versions and fast paths, and says how to fix gaps."""

from __future__ import annotations

import json

from onegpu.cli import doctor
from onegpu.cli.main import main

EXPECTED = {"bf16", "tf32", "sdpa-flash", "sdpa-mem-efficient", "sdpa-math", "adamw-fused", "flash_attn",
            "bitsandbytes", "torchao", "deepspeed", "triton", "peft"}


def test_json_report_has_versions_gpu_and_every_check(capsys):
    import torch

    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torch"] == torch.__version__
    assert {"python", "cuda", "cudnn", "driver", "transformers"} <= set(report["versions"])
    assert set(report["checks"]) == EXPECTED
    for name, c in report["checks"].items():
        assert c["name"] == name and isinstance(c["ok"], bool) and c["detail"]
        assert c["ok"] or c["hint"], f"{name} is missing but has no hint"
    if not torch.cuda.is_available():
        assert report["gpu"] is None and report["checks"]["bf16"]["ok"] is False
        assert report["checks"]["sdpa-math"]["ok"] is True  # the portable kernel always runs
        assert report["checks"]["sdpa-mem-efficient"]["ok"] is False  # a CUDA-only kernel


def test_installed_packages_are_detected_by_trying_them():
    checks = doctor.collect()["checks"]
    assert checks["peft"]["ok"] and checks["bitsandbytes"]["ok"]  # both in this environment
    assert "library loaded" in checks["bitsandbytes"]["detail"]


def test_missing_packages_carry_an_install_hint(monkeypatch):
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda d: None if d in ("peft", "bitsandbytes", "deepspeed") else real(d))
    checks = doctor.collect()["checks"]
    for name, extra in (("peft", "peft"), ("bitsandbytes", "bnb"), ("deepspeed", "deepspeed")):
        assert checks[name]["ok"] is False and f"onegpu[{extra}]" in checks[name]["hint"]


def test_table_output_names_each_check(capsys):
    assert doctor.cli([]) == 0
    out = capsys.readouterr().out
    assert "fast path" in out and "sdpa-math" in out and "peft" in out
