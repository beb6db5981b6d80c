"""The host link: effective rate, host memory per GPU, exposed copy time."""

from __future__ import annotations

import pytest

from ckplan.hardware.gpus import GPUError, gpu_from_mapping
from ckplan.hardware.host_link import (
    copy_seconds,
    exposed_copy_seconds,
    host_link_bytes_per_second,
    host_memory_per_gpu,
)

BASE = {
    "name": "t",
    "memory_bytes": 80 * 2**30,
    "bf16_flops": 1e15,
    "fp32_flops": 1e14,
    "hbm_bytes_per_s": 3e12,
    "link_bytes_per_s": 4e11,
    "gpus_per_node": 8,
    "network_bytes_per_s": 5e10,
}


def test_defaults_are_pcie_gen4_and_a_terabyte():
    gpu = gpu_from_mapping(BASE)
    assert host_link_bytes_per_second(gpu) == pytest.approx(32e9 * 0.8)
    assert host_memory_per_gpu(gpu) == 10**12 // 8


def test_shared_link_divides_the_rate():
    gpu = gpu_from_mapping({**BASE, "host_bytes_per_s": 64e9, "gpus_per_host_link": 2})
    assert host_link_bytes_per_second(gpu) == pytest.approx(64e9 * 0.8 / 2)
    assert copy_seconds(int(25.6e9), gpu) == pytest.approx(1.0)


def test_exposed_copy_seconds():
    gpu = gpu_from_mapping({**BASE, "host_bytes_per_s": 1e9, "host_link_efficiency": 1})
    # stage 0's 2 GB tape: 2 s copies against a 0.5 s forward and a 3 s backward of stage 1
    assert exposed_copy_seconds([1, 0.5, 1], [2, 3, 2], [(0, 2 * 10**9)], gpu) == 1.5


def test_shared_link_cannot_exceed_node():
    with pytest.raises(GPUError, match="gpus_per_host_link"):
        gpu_from_mapping({**BASE, "gpus_per_host_link": 9})
