"""`onegpu doctor` runs on a CPU-only machine, reports versions and fast paths, and says how to fix
gaps."""

from __future__ import annotations

import json
import sys

import pytest

from onegpu.cli import doctor
from onegpu.cli.main import main

EXPECTED = {
    "bf16",
    "tf32",
    "sdpa-flash",
    "sdpa-mem-efficient",
    "sdpa-math",
    "adamw-fused",
    "flash_attn",
    "bitsandbytes",
    "torchao",
    "deepspeed",
    "triton",
    "peft",
}


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


# bitsandbytes/cextension.py of three installs: working, broken import, native library not loaded
FAKE_BNB = {
    "works": "BNB_BACKEND = 'CPU'\nclass NativeLibrary:\n    compiled_with_cuda = False\n"
    "lib = NativeLibrary()\n",
    "no-import": "raise ImportError('libbitsandbytes_cpu.so: cannot open shared object file')\n",
    "no-library": "BNB_BACKEND = 'CUDA'\nclass ErrorHandlerMockBNBNativeLibrary:\n    pass\n"
    "lib = ErrorHandlerMockBNBNativeLibrary()\n",
}


def _install_fake(root, dist: str, version: str, files: dict) -> None:
    """A package as pip leaves it: the module files and a dist-info folder with its version."""
    info = root / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder first on sys.path, for fake installs of peft and bitsandbytes; the real modules are
    hidden while the test runs and put back after it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] in ("peft", "bitsandbytes")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("peft", "bitsandbytes")]:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.mark.parametrize(
    "bnb, ok, detail",
    [
        ("works", True, "9.9.9, CPU library loaded"),
        (
            "no-import",
            False,
            "9.9.9 does not import: libbitsandbytes_cpu.so: cannot open shared object file",
        ),
        ("no-library", False, "9.9.9: native CUDA library failed to load"),
    ],
)
def test_installed_packages_are_detected_by_trying_them(fake_site, bnb, ok, detail):
    """Installed (a version in the metadata) is not enough: each package is imported, and
    bitsandbytes' native library loaded, and a package that fails is reported with why."""
    _install_fake(
        fake_site,
        "bitsandbytes",
        "9.9.9",
        {"bitsandbytes/__init__.py": "", "bitsandbytes/cextension.py": FAKE_BNB[bnb]},
    )
    _install_fake(
        fake_site, "peft", "9.9.9", {"peft/__init__.py": "raise ImportError('needs torch>=99')\n"}
    )
    checks = doctor.collect()["checks"]
    assert (checks["bitsandbytes"]["ok"], checks["bitsandbytes"]["detail"]) == (ok, detail)
    assert (checks["peft"]["ok"], checks["peft"]["detail"]) == (
        False,
        "9.9.9 does not import: needs torch>=99",
    )
    assert checks["peft"]["hint"] == "pip install --force-reinstall peft"


def test_missing_packages_carry_an_install_hint(monkeypatch):
    real = doctor._installed
    monkeypatch.setattr(
        doctor,
        "_installed",
        lambda d: None if d in ("peft", "bitsandbytes", "deepspeed") else real(d),
    )
    checks = doctor.collect()["checks"]
    for name, extra in (("peft", "peft"), ("bitsandbytes", "bnb"), ("deepspeed", "deepspeed")):
        assert checks[name]["ok"] is False and f"onegpu[{extra}]" in checks[name]["hint"]


def test_table_output_names_each_check(capsys):
    assert doctor.cli([]) == 0
    out = capsys.readouterr().out
    assert "fast path" in out and "sdpa-math" in out and "peft" in out


def test_the_report_says_which_engine_policy_rows_are_on_and_why(capsys):
    """doctor prints each of this device's engine policy rows, on (none is switched off here),
    with what it measured and its results file, and how to switch one off."""
    from onegpu.infer import policy

    assert doctor.cli([]) == 0
    out = capsys.readouterr().out
    assert "engine policy (off: --policy_off ROW[,ROW]" in out  # rich wraps at the width
    report = doctor.collect()
    for name, rule in policy.RULES.items():
        mine = rule.device in ("cpu", "any")
        line = f"on  {name}: {rule.why} ({rule.results}; shapes {', '.join(rule.shapes)})"
        assert (line in report["engine_policy"]) == mine, name
        assert (f"on  {name}: " in out) == mine, name
