"""Measurements of two known cards, for judging the verdict without a GPU.

Counting conventions are the doctor's: dp4a = 8 ops, HFMA2 = 4 flops, FFMA = 2 flops, tensor-core
multiply-adds = 2 flops, device copy = read + write bytes.
"""

from __future__ import annotations

import pytest

from cmpchat.doctor.measurements import GpuMeasurements
from cmpchat.doctor.verdict import Finding


def cmp_100_210(index: int = 0, peers: tuple[int, ...] = ()) -> GpuMeasurements:
    """A CMP 100-210 from docs/hardware.md's figures: 818 GB/s read; DP4A 17.2 TOPS counted as 4 multiply-adds per
    dp4a = 4.3e12 dp4a/s = 34.4 TOPS at 8 ops; HFMA2 ~22 TFLOPS; FP32 ~10 TFLOPS; tensor cores throttled
    64×, capped near 5-6 TFLOPS; PCIe Gen1 x1 (~0.25 GB/s raw); no P2P. The copy figure is an estimate
    (a copy streams at about the read rate, as on the H200)."""
    return GpuMeasurements(
        index=index,
        name="NVIDIA CMP 100-210",
        compute_capability=(7, 0),
        multiprocessors=68,
        memory_bytes=16 * 2**30,
        read_bytes_per_s=818e9,
        copy_bytes_per_s=800e9,
        dp4a_ops_per_s=4.3e12 * 8,
        hfma2_flops_per_s=22e12,
        ffma_flops_per_s=10e12,
        tensor_core_flops_per_s=5.5e12,
        host_to_device_bytes_per_s=0.23e9,
        device_to_host_bytes_per_s=0.22e9,
        peer_access=dict.fromkeys(peers, False),
    )


def h200(index: int = 0, peers: tuple[int, ...] = ()) -> GpuMeasurements:
    """An H200 (132 SMs) as `cmpchat doctor --tensor-cores` measured it (twice, within 1%): read 4.57 TB/s,
    copy 4.25 TB/s, DP4A 128 TOPS, HFMA2 106 TFLOPS, FP32 FMA 56 TFLOPS, tensor cores 628 TFLOPS (wmma;
    m8n8k4 mma.sync reached only 16, emulated), PCIe Gen5 x16 55 GB/s each way; P2P as over NVLink."""
    return GpuMeasurements(
        index=index,
        name="NVIDIA H200",
        compute_capability=(9, 0),
        multiprocessors=132,
        memory_bytes=int(139.8 * 2**30),
        read_bytes_per_s=4.57e12,
        copy_bytes_per_s=4.25e12,
        dp4a_ops_per_s=128.4e12,
        hfma2_flops_per_s=106.1e12,
        ffma_flops_per_s=56.3e12,
        tensor_core_flops_per_s=628e12,
        host_to_device_bytes_per_s=55.3e9,
        device_to_host_bytes_per_s=55.3e9,
        peer_access=dict.fromkeys(peers, True),
    )


def throttled_paths(findings: list[Finding], gpu: int) -> set[str]:
    """The paths judged throttled on one GPU."""
    return {f.path for f in findings if f.gpus == (gpu,) and f.throttled and f.path != "summary"}


@pytest.fixture
def two_cmps() -> list[GpuMeasurements]:
    return [cmp_100_210(0, peers=(1,)), cmp_100_210(1, peers=(0,))]


@pytest.fixture
def two_h200s() -> list[GpuMeasurements]:
    return [h200(0, peers=(1,)), h200(1, peers=(0,))]
