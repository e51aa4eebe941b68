"""Running the hardware probes on each chosen GPU, each GPU's probes inside its own CUDA context."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cmpchat.backends.gpu.device import cuda_gpu_present
from cmpchat.doctor.measurements import GpuMeasurements
from cmpchat.errors import CmpchatError

Progress = Callable[[str, int, int], None]
"""`progress(stage, done, total)`, as the commands' `StderrProgress` takes it."""


@dataclass(frozen=True)
class ProbeSizes:
    """How long the probes run. Reads and copies stay at 1 GiB in both modes: reads are decode's denominator,
    and a smaller copy finishes before Python queues the next one (the H200 copied 256 MiB at half speed)."""

    read_bytes: int
    read_repeats: int
    copy_bytes: int
    copy_repeats: int
    host_bytes: int
    host_repeats: int
    seconds_per_launch: float
    compute_repeats: int


FULL = ProbeSizes(1 << 30, 20, 1 << 30, 10, 256 << 20, 2, 0.005, 10)
QUICK = ProbeSizes(1 << 30, 5, 1 << 30, 3, 32 << 20, 2, 0.002, 3)


def visible_gpu_count() -> int:
    """How many CUDA GPUs this process may use; a CmpchatError when none (Numba's simulator counts as none)."""
    from numba.cuda import config

    if config.ENABLE_CUDASIM:
        raise CmpchatError("no CUDA GPU: NUMBA_ENABLE_CUDASIM is set, and the simulator has no hardware to measure")
    if not cuda_gpu_present():
        raise CmpchatError("no CUDA GPU: no usable NVIDIA driver and device; cmpchat doctor measures GPUs")
    from numba import cuda

    return len(cuda.gpus)


def choose_gpus(requested: Sequence[int] | None, count: int) -> list[int]:
    """The GPU indices to measure: those requested (in order, once each), else every one of `count`."""
    if not requested:
        return list(range(count))
    for index in requested:
        if not 0 <= index < count:
            raise CmpchatError(f"GPU {index} does not exist; this machine has {count} (0 to {count - 1})")
    return list(dict.fromkeys(requested))


def measure_gpus(
    requested: Sequence[int] | None = None,
    *,
    tensor_cores: bool = False,
    quick: bool = False,
    progress: Progress | None = None,
) -> list[GpuMeasurements]:
    """Measure each requested GPU (all by default); the tensor-core probe runs only when `tensor_cores`."""
    count = visible_gpu_count()
    every_gpu = list(range(count))
    return [
        measure_gpu(index, every_gpu, tensor_cores=tensor_cores, sizes=QUICK if quick else FULL, progress=progress)
        for index in choose_gpus(requested, count)
    ]


def measure_gpu(
    index: int,
    peers: list[int],
    *,
    tensor_cores: bool = False,
    sizes: ProbeSizes = FULL,
    progress: Progress | None = None,
) -> GpuMeasurements:
    """Every probe on GPU `index`, in that GPU's context; P2P is checked towards each of `peers`."""
    from numba import cuda
    from numba.cuda.cudadrv.error import CudaDriverError

    from cmpchat.kernels import throughput_probes as probes

    steps: list[tuple[str, Callable[[], object]]] = [
        ("streaming read", lambda: probes.streaming_read_bandwidth(sizes.read_bytes, sizes.read_repeats)),
        ("device copy", lambda: probes.device_copy_bandwidth(sizes.copy_bytes, sizes.copy_repeats)),
        ("DP4A", lambda: probes.compute_rate(probes.DP4A_PROBE, sizes.seconds_per_launch, sizes.compute_repeats)),
        ("HFMA2", lambda: probes.compute_rate(probes.HFMA2_PROBE, sizes.seconds_per_launch, sizes.compute_repeats)),
        ("FFMA", lambda: probes.compute_rate(probes.FFMA_PROBE, sizes.seconds_per_launch, sizes.compute_repeats)),
    ]
    if tensor_cores:
        from cmpchat.kernels.tensor_core_probe import mma_rate

        steps.append(("tensor cores", lambda: mma_rate(sizes.seconds_per_launch, sizes.compute_repeats)))
    steps += [
        ("host link", lambda: probes.host_link_bandwidth(sizes.host_bytes, sizes.host_repeats)),
        ("P2P", lambda: probes.peer_access(peers)),
    ]
    with cuda.gpus[index]:
        device = cuda.get_current_device()
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        results: dict[str, Any] = {}
        for done, (step, run) in enumerate(steps):
            if progress is not None:
                progress(f"GPU {index} ({name}): {step}", done, len(steps))
            try:
                results[step] = run()
            except CudaDriverError as error:  # out of memory (a busy GPU), a driver fault: one line for the user
                raise CmpchatError(f"GPU {index}: the {step} probe failed: {error}") from error
        if progress is not None:
            progress(f"GPU {index} ({name}): done", len(steps), len(steps))
        _, total = cuda.current_context().get_memory_info()
        to_device, to_host = results["host link"]
        return GpuMeasurements(
            index=index,
            name=name,
            compute_capability=tuple(device.compute_capability),
            multiprocessors=int(device.MULTIPROCESSOR_COUNT),
            memory_bytes=int(total),
            read_bytes_per_s=results["streaming read"],
            copy_bytes_per_s=results["device copy"],
            dp4a_ops_per_s=results["DP4A"],
            hfma2_flops_per_s=results["HFMA2"],
            ffma_flops_per_s=results["FFMA"],
            tensor_core_flops_per_s=results.get("tensor cores"),
            host_to_device_bytes_per_s=to_device,
            device_to_host_bytes_per_s=to_host,
            peer_access=results["P2P"],
        )
