"""The GPU readings every front end shows: a fake sampler in CI, a fake NVML for the reading code, and the real
NVML on a GPU machine (`pytest -m gpu`)."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from cmpchat.backends.base import StageSummary
from cmpchat.gpu_readings import (
    FakeGpuSampler,
    GpuMonitor,
    GpuReading,
    GpuStage,
    NvmlSampler,
    UnavailableSampler,
    activity,
    open_nvml_sampler,
    stages_of,
    throttle_names,
)

GIB = 2**30
PID = 4242


def test_fake_sampler_is_deterministic_and_moves():
    a, b = FakeGpuSampler(3), FakeGpuSampler(3)
    first = a.read()
    assert first == b.read() and len(first) == 3
    assert a.read() != first  # the next reading differs
    for r in first:
        assert r.utilization is not None and r.memory_used is not None and r.memory_total is not None
        assert 0 <= r.utilization <= 100 and r.memory_used < r.memory_total
        assert r.memory_cmpchat is not None and r.memory_cmpchat <= r.memory_used
        assert r.throttle_reasons is not None and r.pcie_generation == 1


class FakeNvml(types.SimpleNamespace):
    """Enough of pynvml for NvmlSampler. GPU 1 refuses power, fan and process readings, as some mining cards do;
    this process (PID) runs on GPU 0 only."""

    class NVMLError(Exception):
        pass

    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, count: int, processes: dict[int, list] | None = None) -> None:
        super().__init__()
        self.count = count
        self.shut = False
        self.processes = processes if processes is not None else {0: [process(PID, 10 * GIB), process(7, GIB)]}

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA CMP 100-210"

    def nvmlDeviceGetUUID(self, handle):
        if handle == 1:
            raise self.NVMLError("not supported")
        return b"GPU-5c1f0000-0000-0000-0000-000000000000"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=97 - handle, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=14 * GIB, total=16 * GIB, free=2 * GIB)

    def nvmlDeviceGetPowerUsage(self, handle):
        self._refuse_on_1(handle)
        return 182_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 250_000

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        return 2048 if counter == self.NVML_PCIE_UTIL_RX_BYTES else 512

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return {self.NVML_CLOCK_SM: 1380, self.NVML_CLOCK_MEM: 877}[clock]

    def nvmlDeviceGetFanSpeed(self, handle):
        self._refuse_on_1(handle)
        return 35

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return 1

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return 1 if handle == 0 else 16

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x4 | 0x40 if handle == 0 else 0

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if handle not in self.processes:
            raise self.NVMLError("Not Supported")
        return self.processes[handle]

    def nvmlShutdown(self):
        self.shut = True

    def _refuse_on_1(self, handle):
        if handle == 1:
            raise self.NVMLError("Not Supported")


def process(pid: int, used: int | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


def test_nvml_sampler_converts_units_and_tolerates_refusals():
    nvml = FakeNvml(2)
    sampler = NvmlSampler(nvml, pid=PID)
    first, second = sampler.read()
    assert first == GpuReading(
        index=0,
        name="NVIDIA CMP 100-210",
        utilization=97.0,
        memory_used=14 * GIB,
        memory_total=16 * GIB,
        temperature=71,
        power=182.0,
        power_limit=250.0,
        pcie_rx=2 * 2**20,
        pcie_tx=2**19,
        memory_cmpchat=10 * GIB,
        sm_clock=1380,
        memory_clock=877,
        fan=35,
        pcie_generation=1,
        pcie_width=1,
        throttle_reasons=("sw_power_cap", "hw_thermal"),
        uuid="GPU-5c1f0000-0000-0000-0000-000000000000",
    )
    assert second.power is None and second.power_limit == 250.0 and second.fan is None and second.uuid is None
    assert second.throttle_reasons == () and second.pcie_width == 16
    assert second.memory_cmpchat is None  # its process list is refused
    sampler.close()
    assert nvml.shut


def test_own_memory_is_zero_only_where_this_process_is_known_to_be_absent():
    lists = {0: [process(PID, 3 * GIB), process(PID, GIB)], 1: [process(7, GIB)], 2: []}
    assert [r.memory_cmpchat for r in NvmlSampler(FakeNvml(4, lists), pid=PID).read()] == [4 * GIB, 0, 0, None]
    # Seen nowhere (another PID namespace, or no CUDA context yet): unknown, not 0.
    assert [r.memory_cmpchat for r in NvmlSampler(FakeNvml(2, lists), pid=1).read()] == [None, None]
    unknown = {0: [process(PID, None)], 1: []}  # the driver cannot say how much (Windows' WDDM)
    assert [r.memory_cmpchat for r in NvmlSampler(FakeNvml(2, unknown), pid=PID).read()] == [None, 0]


def test_throttle_reasons_have_short_names_and_unknown_bits_their_value():
    assert throttle_names(0) == ()
    assert throttle_names(0x1) == ("idle",)
    assert throttle_names(0x4 | 0x8 | 0x800) == ("sw_power_cap", "hw_slowdown", "0x800")


def test_no_gpus_is_said_in_one_line(monkeypatch):
    assert NvmlSampler(FakeNvml(0)).problem == "no NVIDIA GPU found"

    def fail() -> None:
        raise FakeNvml.NVMLError("NVML Shared Library Not Found")

    fake = types.ModuleType("pynvml")
    vars(fake).update(NVMLError=FakeNvml.NVMLError, nvmlInit=fail)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = open_nvml_sampler()
    assert isinstance(sampler, UnavailableSampler) and sampler.read() == []
    assert sampler.problem is not None and "\n" not in sampler.problem and "NVML" in sampler.problem


def test_monitor_reads_on_its_own_thread_until_stopped():
    seen: list[list[GpuReading]] = []
    got = threading.Event()

    def on_readings(readings):
        seen.append(readings)
        if len(seen) >= 2:
            got.set()

    monitor = GpuMonitor(FakeGpuSampler(2), on_readings, interval=0.01)
    monitor.start()
    assert got.wait(2)
    monitor.stop()
    count = len(seen)
    assert all(len(r) == 2 for r in seen)
    threading.Event().wait(0.05)
    assert len(seen) == count


def test_monitor_does_not_start_without_gpus():
    monitor = GpuMonitor(UnavailableSampler("no NVIDIA driver"), lambda r: pytest.fail("no readings expected"))
    monitor.start()
    monitor.stop()


def test_activity_names_what_the_requests_do():
    assert activity([]) == "idle"
    assert activity([False]) == "prefill"
    assert activity([True, True]) == "decode"
    assert activity([True, False]) == "prefill+decode"


def test_stages_match_readings_by_uuid_where_both_know_it_else_by_index():
    on_b = GpuStage(0, "GPU-b", 0, range(0, 8), "idle")  # CUDA's GPU 0 is NVML's GPU 1
    unknown = GpuStage(1, None, 1, range(8, 16), "idle")
    stages = [on_b, unknown]
    assert stages_of(GpuReading(0, "CMP", uuid="GPU-a"), stages) == []
    assert stages_of(GpuReading(1, "CMP", uuid="GPU-b"), stages) == [on_b, unknown]  # the second by its index
    assert stages_of(GpuReading(0, "CMP"), stages) == [on_b]


def test_the_models_stages_say_what_its_engine_does(tiny_model_path):
    """`Model.gpu_stages` over a real engine: prefill while a prompt is read, decode, then idle."""
    from tests.scripted_backend import FOREVER
    from tests.server.conftest import scripted_model

    model = scripted_model(tiny_model_path)
    assert model.gpu_stages() is None  # a backend without stages, as the CPU reference
    summaries = [StageSummary(0, 0, "GPU-a", range(0, 2), 0, 0), StageSummary(1, 1, "", range(2, 4), 0, 0)]
    model.backend.stage_summaries = lambda: summaries  # type: ignore[method-assign]
    assert model.gpu_stages() == [
        GpuStage(0, "GPU-a", 0, range(0, 2), "idle"),
        GpuStage(1, None, 1, range(2, 4), "idle"),
    ]
    reading, read = threading.Event(), threading.Event()
    prefill = model.backend.prefill

    def held_prefill(*args, **kwargs):
        reading.set()
        read.wait(10)
        return prefill(*args, **kwargs)

    model.backend.prefill = held_prefill  # type: ignore[method-assign]
    cancel = threading.Event()
    replies = threading.Thread(target=lambda: list(model.generate("SAY:" + FOREVER, cancel=cancel)))
    replies.start()
    try:
        assert reading.wait(10)
        assert {stage.activity for stage in model.gpu_stages() or []} == {"prefill"}
        read.set()
        deadline = time.monotonic() + 10
        while (model.gpu_stages() or [])[0].activity != "decode":
            assert time.monotonic() < deadline, "the request never decoded"
            time.sleep(0.01)
    finally:
        read.set()
        cancel.set()
        replies.join(10)
    assert {stage.activity for stage in model.gpu_stages() or []} == {"idle"}


@pytest.mark.gpu
def test_real_nvml_reads_every_gpu():
    sampler = open_nvml_sampler()
    assert sampler.problem is None, sampler.problem
    readings = sampler.read()
    sampler.close()
    assert readings and all(r.memory_total and r.memory_total > 0 for r in readings)
    assert all(r.utilization is not None and 0 <= r.utilization <= 100 for r in readings)
    assert all(r.temperature is None or 0 < r.temperature < 120 for r in readings)
    assert all(r.pcie_generation is None or 1 <= r.pcie_generation <= 6 for r in readings)
    assert all(r.throttle_reasons is None or isinstance(r.throttle_reasons, tuple) for r in readings)
