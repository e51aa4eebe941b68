"""Per-GPU readings behind a small interface, for every front end: the app's GPU panel and the server's
`/v1/cmpchat/gpus`.

`open_nvml_sampler()` reads NVIDIA's management library through nvidia-ml-py; tests and machines without a GPU
use `FakeGpuSampler` or get a sampler whose `problem` says why there are no readings. `GpuMonitor` reads a sampler
on its own thread so that no caller waits on NVML (a PCIe throughput reading alone takes ~20 ms per GPU).
`GpuStage` is what a GPU does for the model (a pipeline stage, its layers, prefill or decode), from the Python API
(`Model.gpu_stages`) or a server's answer; `activity` is the one rule both use to name the engine's work.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment; a field is None when the driver does not report it."""

    index: int
    name: str
    utilization: float | None = None
    """Percent of time a kernel ran during the last sample period."""
    memory_used: int | None = None
    """Bytes, by every process."""
    memory_total: int | None = None
    temperature: int | None = None
    """Degrees Celsius."""
    power: float | None = None
    """Watts."""
    power_limit: float | None = None
    pcie_rx: float | None = None
    """Bytes per second into the GPU."""
    pcie_tx: float | None = None
    memory_cmpchat: int | None = None
    """Bytes this process holds on the GPU."""
    sm_clock: int | None = None
    """MHz."""
    memory_clock: int | None = None
    """MHz."""
    fan: int | None = None
    """Percent of the fan's top speed."""
    pcie_generation: int | None = None
    """The link's current generation and lane count (a CMP 100-210 runs Gen1 x1)."""
    pcie_width: int | None = None
    throttle_reasons: tuple[str, ...] | None = None
    """Why the clocks are held down now, as `THROTTLE_REASONS` names them; () when nothing holds them."""
    uuid: str | None = None
    """"GPU-…": the card whatever order NVML and CUDA number the cards in."""


@dataclass(frozen=True, slots=True)
class GpuStage:
    """One pipeline stage of the model: the GPU that holds it, its layers and what the engine is doing."""

    gpu_index: int
    """CUDA's index of the GPU (NVML may number the cards otherwise: match by `uuid` where known)."""
    uuid: str | None
    stage: int
    layers: range
    activity: str
    """"idle", "prefill", "decode" or "prefill+decode" (`activity`): the same on every stage, since every stage
    takes part in each engine step."""


def activity(decoding: Iterable[bool]) -> str:
    """What the engine's requests are doing, from whether each one (admitted, or holding a server slot) has
    begun to decode: "idle" (none), "prefill" (reading prompts), "decode" or "prefill+decode"."""
    work = {"decode" if busy else "prefill" for busy in decoding}
    return "+".join(name for name in ("prefill", "decode") if name in work) or "idle"


def stages_of(reading: GpuReading, stages: Sequence[GpuStage]) -> list[GpuStage]:
    """The stages held by the GPU of `reading`: matched by uuid where both know it (NVML's and CUDA's indices
    differ under `CUDA_VISIBLE_DEVICES` or without `CUDA_DEVICE_ORDER=PCI_BUS_ID`), else by index."""
    return [
        stage
        for stage in stages
        if (stage.uuid == reading.uuid if stage.uuid and reading.uuid else stage.gpu_index == reading.index)
    ]


THROTTLE_REASONS: dict[int, str] = {
    0x1: "idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}
"""NVML's clock throttle reason bits (`nvmlClocksThrottleReason*`, stable in its ABI) by short name; a bit not
listed here is named by its hex value."""


def throttle_names(mask: int) -> tuple[str, ...]:
    """The names of the bits set in an NVML throttle-reason mask, lowest bit first."""
    return tuple(THROTTLE_REASONS.get(1 << bit, hex(1 << bit)) for bit in range(mask.bit_length()) if mask >> bit & 1)


class GpuSampler(Protocol):
    """Something that reads every GPU; `problem` is a one-line reason when there is nothing to read."""

    problem: str | None

    def read(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


class UnavailableSampler:
    """No GPUs to read, and why."""

    def __init__(self, problem: str) -> None:
        self.problem: str | None = problem

    def read(self) -> list[GpuReading]:
        return []

    def close(self) -> None:
        pass


class FakeGpuSampler:
    """Readings that move smoothly and repeat exactly: for tests, screenshots and machines without GPUs."""

    def __init__(self, count: int = 4, *, name: str = "NVIDIA CMP 100-210", busy: bool = True) -> None:
        self.problem: str | None = None
        self.count = count
        self.name = name
        self.busy = busy
        self.step = 0

    def read(self) -> list[GpuReading]:
        readings = []
        for index in range(self.count):
            wave = 0.5 + 0.5 * math.sin(self.step * 0.7 + index * 1.3)
            load = (55 + 43 * wave) if self.busy else 3 * wave
            power = round(40 + 1.5 * load)
            throttle = ("sw_power_cap",) if power > 170 else () if self.busy else ("idle",)
            readings.append(
                GpuReading(
                    index=index,
                    name=self.name,
                    utilization=round(load),
                    memory_used=int((12.5 + index * 0.3) * 2**30),
                    memory_total=16 * 2**30,
                    temperature=round(50 + 0.2 * load + index * 2),
                    power=power,
                    power_limit=250.0,
                    pcie_rx=(1.5 + wave) * 2**20,
                    pcie_tx=(0.2 + wave / 4) * 2**20,
                    memory_cmpchat=int((12 + index * 0.3) * 2**30),
                    sm_clock=round(1100 + 300 * wave) if self.busy else 135,
                    memory_clock=877,  # HBM2's clock, which does not move
                    fan=None,  # mining cards are passively cooled
                    pcie_generation=1,
                    pcie_width=1,
                    throttle_reasons=throttle,
                )
            )
        self.step += 1
        return readings

    def close(self) -> None:
        pass


class NvmlSampler:
    """Reads every GPU through NVML; a reading the driver refuses (common on mining cards) becomes None.

    `pid` is the process whose memory is `memory_cmpchat` (this one by default)."""

    def __init__(self, nvml: Any, pid: int | None = None) -> None:
        self.problem: str | None = None
        self._nvml = nvml
        self._pid = os.getpid() if pid is None else pid
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._names = [_text(self._call(nvml.nvmlDeviceGetName, handle) or "GPU") for handle in self._handles]
        self._uuids = [self._call(nvml.nvmlDeviceGetUUID, handle) for handle in self._handles]
        if not self._handles:
            self.problem = "no NVIDIA GPU found"

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        own = self._own_memory()
        readings = []
        for index, handle in enumerate(self._handles):
            rates = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
            limit = self._call(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            rx = self._call(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            tx = self._call(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
            throttle = self._call(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
            readings.append(
                GpuReading(
                    index=index,
                    name=self._names[index],
                    uuid=None if self._uuids[index] is None else _text(self._uuids[index]),
                    utilization=None if rates is None else float(rates.gpu),
                    memory_used=None if memory is None else int(memory.used),
                    memory_total=None if memory is None else int(memory.total),
                    temperature=self._call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                    power=None if power is None else power / 1000.0,  # NVML reports milliwatts
                    power_limit=None if limit is None else limit / 1000.0,
                    pcie_rx=None if rx is None else rx * 1024.0,  # NVML reports KB/s
                    pcie_tx=None if tx is None else tx * 1024.0,
                    memory_cmpchat=own[index],
                    sm_clock=self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                    memory_clock=self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
                    fan=self._call(nvml.nvmlDeviceGetFanSpeed, handle),
                    pcie_generation=self._call(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                    pcie_width=self._call(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
                    throttle_reasons=None if throttle is None else throttle_names(int(throttle)),
                )
            )
        return readings

    def _own_memory(self) -> list[int | None]:
        """This process's bytes on each GPU. A GPU whose process list does not show it reads 0 only when another
        GPU's list does: in a container the list shows the host's process ids, and then nothing can be known."""
        used: list[int | None] = []
        absent: list[bool] = []  # the GPU's process list was read and does not show this process
        seen = False
        for handle in self._handles:
            processes = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, handle)
            ours = [p.usedGpuMemory for p in processes or () if p.pid == self._pid]
            absent.append(processes is not None and not ours)
            seen = seen or bool(ours)
            # usedGpuMemory is None where the driver cannot say (Windows' WDDM).
            used.append(sum(ours) if ours and None not in ours else None)
        return [0 if is_absent and seen else bytes_ for bytes_, is_absent in zip(used, absent, strict=True)]

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except self._nvml.NVMLError:
            return None


def open_nvml_sampler() -> GpuSampler:
    """An NVML sampler, or an `UnavailableSampler` saying why there is none (no package, driver or GPU)."""
    try:
        import pynvml
    except ImportError:
        return UnavailableSampler("no GPU readings: nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return UnavailableSampler(
            f"no GPU readings: NVML did not start ({_text(str(err))}); is the NVIDIA driver loaded?"
        )
    try:
        sampler = NvmlSampler(pynvml)
    except pynvml.NVMLError as err:
        return UnavailableSampler(f"no GPU readings: {_text(str(err))}")
    return sampler if sampler.problem is None else UnavailableSampler(sampler.problem)


class GpuMonitor:
    """Reads `sampler` every `interval` seconds on a daemon thread and hands each reading to `on_readings`.

    `on_readings` runs on that thread: give it something thread-safe, such as `App.post_message`, or a setter
    of a value other threads only read.
    """

    def __init__(
        self, sampler: GpuSampler, on_readings: Callable[[list[GpuReading]], None], interval: float = 1.0
    ) -> None:
        self.sampler = sampler
        self.interval = interval
        self._on_readings = on_readings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmpchat-gpu-monitor", daemon=True)

    def start(self) -> None:
        if self.sampler.problem is None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.sampler.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                readings = self.sampler.read()
            except Exception as err:  # a driver hiccup must not kill the monitor or its front end
                readings = []
                self.sampler.problem = f"readings stopped: {err}"
            self._on_readings(readings)
            if self.sampler.problem is not None:
                return
            self._stop.wait(self.interval)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
