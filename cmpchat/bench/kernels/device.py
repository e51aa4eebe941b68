"""The GPU the kernel micro-benchmarks run on, and the tuning row they time (`cmpchat/kernels/device_table.py`)."""

from __future__ import annotations

from functools import cache

from cmpchat.backends.gpu.device import GpuInfo, gpu_info
from cmpchat.kernels.device_table import DeviceTuning, default_tuning


@cache
def bench_gpu() -> tuple[GpuInfo, DeviceTuning]:
    """GPU 0, where the benchmarks run, as the CUDA backend reads it, and the row it runs: its own, or the one
    CMPCHAT_TUNING names (`CMPCHAT_TUNING=sm_70` times the CMP's choices on any GPU)."""
    gpu = gpu_info(0)
    return gpu, default_tuning(gpu)
