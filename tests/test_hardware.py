"""GPU catalog lookups, device matching, and the measured CPU figures."""

from __future__ import annotations

import os
import re

import pytest

from onegpu import hardware
from onegpu.errors import ConfigError, UnavailableError
from onegpu.hardware import CATALOG, DeviceInfo, find_gpu, match_device


@pytest.mark.parametrize(
    "name,key",
    [
        ("h100", "H100"),
        ("H100 PCIe", "H100-PCIe"),
        ("a100-40gb", "A100-40GB"),
        ("A100", "A100-80GB"),
        ("rtx 4090", "RTX4090"),
        ("RTX3090", "RTX3090"),
        ("t4", "T4"),
        ("L4", "L4"),
        ("b200", "B200"),
        ("NVIDIA H200", "H200"),
        ("a10g", "A10G"),
        ("V100", "V100"),
    ],
)
def test_find_gpu_by_name_and_alias(name, key):
    assert find_gpu(name).key == key


def test_unknown_gpu_suggests_the_closest():
    with pytest.raises(ConfigError) as err:
        find_gpu("h10")
    assert "did you mean 'H100'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        find_gpu("quantum-9000")
    assert "known GPUs" in str(err.value)


@pytest.mark.parametrize(
    "reported,gib,key",
    [
        ("NVIDIA H100 80GB HBM3", 79.1, "H100"),
        ("NVIDIA H100 PCIe", 79.1, "H100-PCIe"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
        ("Tesla T4", 14.6, "T4"),
        ("NVIDIA H200", 139.8, "H200"),
        ("NVIDIA GeForce RTX 4090", 23.6, "RTX4090"),
        ("NVIDIA H100 NVL", 93.1, "H100-NVL"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
    ],
)
def test_detected_device_matches_catalog(reported, gib, key):
    dev = DeviceInfo("cuda", reported, int(gib * 2**30), (9, 0))
    assert match_device(dev).key == key


def test_uncatalogued_gpu_is_a_clear_error():
    with pytest.raises(UnavailableError) as err:
        hardware.spec_from_device(DeviceInfo("cuda", "Mystery Accelerator", 8 * 2**30, (8, 0)))
    assert "--gpu" in str(err.value)


def test_catalog_figures_are_consistent():
    for g in CATALOG:
        assert g.bf16 >= g.fp32 > 0 and g.bandwidth_gbs > 0 and g.memory_gib > 10
        assert g.has_bf16 == (g.capability >= (8, 0))  # Ampere and later
        assert (g.tf32 > 0) == (g.capability >= (8, 0))
        assert g.peak_tflops("bf16") == g.bf16 and g.peak_tflops("fp32", tf32=False) == g.fp32


def test_cpu_throughput_is_measured_once_and_cached(monkeypatch):
    first = hardware.measure_cpu(force=True)
    assert first["tflops"] > 1e-4 and first["bandwidth_gbs"] > 0.1

    def boom(*a, **k):
        raise AssertionError("should come from the cache")

    monkeypatch.setattr(hardware, "measure_matmul_flops", boom)
    assert hardware.measure_cpu() == first
    spec = hardware.spec_from_device(hardware.detect())
    assert spec.key == "CPU" and spec.fp32 == pytest.approx(first["tflops"])


def test_detect_keeps_its_fields():
    """What detect() reports is this machine: a CUDA GPU's own properties where torch sees one,
    else the CPU with the host's total RAM (read here from /proc/meminfo), and never bf16 or TF32
    off a CUDA GPU."""
    import torch

    dev = hardware.detect()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        assert (dev.type, dev.name, dev.total_memory, dev.capability) == (
            "cuda",
            props.name,
            props.total_memory,
            (props.major, props.minor),
        )
        assert dev.bf16 == dev.tf32 == (dev.capability >= (8, 0)) and dev.is_gpu
        return
    if torch.backends.mps.is_available():
        pytest.skip("an Apple GPU: its memory is the host's, read by psutil alone")
    meminfo = open("/proc/meminfo").read() if os.path.exists("/proc/meminfo") else ""
    total = re.search(r"^MemTotal:\s+(\d+) kB$", meminfo, re.M)
    if total is None:
        pytest.skip("no /proc/meminfo to read the host's RAM from")
    assert (dev.type, dev.name, dev.capability) == ("cpu", "CPU", None)
    assert dev.total_memory == int(total.group(1)) * 1024
    assert not dev.is_gpu and not dev.bf16 and not dev.tf32
