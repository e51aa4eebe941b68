"""Finding the GPU and how much of its memory cmpchat may use."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from cmpchat.errors import CmpchatError


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    free_bytes: int
    total_bytes: int
    multiprocessors: int
    uuid: str = ""
    """"GPU-…", as NVML names the same card (its indices may differ from CUDA's); empty where unknown."""


def cuda_gpu_present() -> bool:
    """Whether a real NVIDIA GPU and driver are usable (never true under Numba's CUDA simulator)."""
    from cmpchat.cudart.target import activate

    try:
        from numba.cuda import config

        if config.ENABLE_CUDASIM:
            return False
    except Exception:  # no driver, broken install: the CPU backend still works
        return False
    activate()  # the code path CMPCHAT_PROFILE names, before Numba loads an NVVM (cuda.is_available does)
    try:
        from numba import cuda

        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:  # no driver, broken install: the CPU backend still works
        return False


SIMULATED_GPU = GpuInfo(0, "Numba CUDA simulator", (7, 0), 16 * 2**30, 16 * 2**30, 1)
"""What the backend sees under the simulator (CI runs the whole GPU engine there at tiny shapes)."""


def gpu_info(index: int = 0) -> GpuInfo:
    """GPU `index` as the engine plans for it: under a code-path profile (CMPCHAT_PROFILE=cmp, `cudart/target.py`)
    with the card's SM count and its name marked."""
    from numba import cuda
    from numba.cuda import config

    from cmpchat.cudart import target

    if config.ENABLE_CUDASIM:
        return SIMULATED_GPU
    if not cuda_gpu_present():  # which applies the profile first
        raise CmpchatError("no NVIDIA GPU is usable (no driver or no device); use --backend cpu")
    if index >= len(cuda.gpus):
        raise CmpchatError(f"GPU {index} does not exist; this machine has {len(cuda.gpus)}")
    with cuda.gpus[index]:
        device = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        sms = target.engine_multiprocessors(int(device.MULTIPROCESSOR_COUNT))
        uuid = str(getattr(device, "uuid", ""))
        return GpuInfo(index, target.gpu_name(name), tuple(device.compute_capability), int(free), int(total), sms, uuid)


def gpu_count() -> int:
    """GPUs this process may use (the simulator's one counts)."""
    from numba import cuda
    from numba.cuda import config

    if config.ENABLE_CUDASIM:
        return 1
    return len(cuda.gpus) if cuda_gpu_present() else 0


def stage_budgets(gpus: Sequence[GpuInfo], caps: int | Sequence[int | None] | None) -> list[int]:
    """Memory each stage may plan with: what its GPU has free, shared evenly by the stages on that GPU, capped
    by `--gpu-mem` (one size for every stage, or one per stage; to emulate 16 GB cards) and, under a code-path
    profile, by its card's memory (`cudart.target.stage_memory_cap`)."""
    from cmpchat.cudart.target import stage_memory_cap

    per_stage = [caps] * len(gpus) if caps is None or isinstance(caps, int) else list(caps)
    if len(per_stage) != len(gpus):
        raise CmpchatError(f"--gpu-mem gives {len(per_stage)} sizes for {len(gpus)} stages; give one, or one per stage")
    if any(cap is not None and cap <= 0 for cap in per_stage):
        raise CmpchatError("--gpu-mem must be a positive size, e.g. 16G")
    sharing = Counter(info.index for info in gpus)
    budgets = []
    for info, cap in zip(gpus, per_stage, strict=True):
        share = info.free_bytes // sharing[info.index]
        budget = share if cap is None else min(share, cap)
        card = stage_memory_cap(info.index, info.free_bytes, info.total_bytes)
        budgets.append(budget if card is None else min(budget, card))
    return budgets


def parse_size(text: str) -> int:
    """'16G', '15.5GiB', '800M', '17179869184' → bytes (powers of two)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (cleaned[:-1], cleaned[-1]) if cleaned and cleaned[-1] in units else (cleaned, "")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise CmpchatError(f"cannot read the size '{text}'; write it like 16G or 800M") from None
    return int(value)
