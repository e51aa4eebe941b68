"""The GPU panel and its samplers: a fake sampler in CI, a fake NVML for the reading code, and the real
NVML on a GPU machine (`pytest -m gpu`)."""

from __future__ import annotations

import threading
import types

import pytest
from textual.geometry import Region

from cmpchat.tui.gpu_sampler import (
    FakeGpuSampler,
    GpuMonitor,
    GpuReading,
    NvmlSampler,
    UnavailableSampler,
    open_nvml_sampler,
)
from cmpchat.tui.widgets.gpu_panel import GpuPanel, summary
from tests.tui.helpers import plain, wait_for

GIB = 2**30


def test_fake_sampler_is_deterministic_and_moves():
    a, b = FakeGpuSampler(3), FakeGpuSampler(3)
    first = a.read()
    assert first == b.read() and len(first) == 3
    assert a.read() != first  # the next reading differs
    for r in first:
        assert r.utilization is not None and r.memory_used is not None and r.memory_total is not None
        assert 0 <= r.utilization <= 100 and r.memory_used < r.memory_total


class FakeNvml(types.SimpleNamespace):
    """Enough of pynvml for NvmlSampler; GPU 1 refuses power readings, as some mining cards do."""

    class NVMLError(Exception):
        pass

    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.shut = False

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA CMP 100-210"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=97 - handle, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=14 * GIB, total=16 * GIB, free=2 * GIB)

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 182_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 250_000

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        return 2048 if counter == self.NVML_PCIE_UTIL_RX_BYTES else 512

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 71

    def nvmlShutdown(self):
        self.shut = True


def test_nvml_sampler_converts_units_and_tolerates_refusals():
    nvml = FakeNvml(2)
    sampler = NvmlSampler(nvml)
    first, second = sampler.read()
    assert first == GpuReading(0, "NVIDIA CMP 100-210", 97.0, 14 * GIB, 16 * GIB, 71, 182.0, 250.0, 2 * 2**20, 2**19)
    assert second.power is None and second.power_limit == 250.0
    sampler.close()
    assert nvml.shut


def test_no_gpus_is_said_in_one_line(monkeypatch):
    assert NvmlSampler(FakeNvml(0)).problem == "no NVIDIA GPU found"

    def fail() -> None:
        raise FakeNvml.NVMLError("NVML Shared Library Not Found")

    fake = types.ModuleType("pynvml")
    vars(fake).update(NVMLError=FakeNvml.NVMLError, nvmlInit=fail)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
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


def test_summary_for_the_status_bar():
    readings = tuple(FakeGpuSampler(3, busy=True).read())
    text = summary(readings)
    assert text.startswith("GPU ") and text.count("/") >= 3 and "GB" in text
    assert summary(()) == ""


@pytest.mark.asyncio
async def test_gpu_panel_layouts_and_colour_thresholds():
    from textual.app import App, ComposeResult

    class PanelApp(App[None]):
        def compose(self) -> ComposeResult:
            yield GpuPanel(id="narrow")
            yield GpuPanel(id="wide", title=False)

        CSS = "#narrow { width: 34; } #wide { width: 80; }"

    readings = (
        GpuReading(0, "a", 5.0, 1 * GIB, 16 * GIB, 60, 50.0, 250.0, 2**20, 2**20),
        GpuReading(1, "b", 97.0, int(15.5 * GIB), 16 * GIB, 88, 240.0, 250.0, 2**20, 2**20),
    )
    app = PanelApp()
    async with app.run_test(size=(120, 30)) as pilot:
        narrow, wide = app.query_one("#narrow", GpuPanel), app.query_one("#wide", GpuPanel)
        for panel in (narrow, wide):
            panel.readings = readings
        await pilot.pause()
        narrow_lines = plain(narrow).splitlines()
        assert narrow_lines[0] == "GPUs" and len(narrow_lines) == 5  # title + two lines per GPU
        assert max(len(line) for line in narrow_lines) <= 32
        assert narrow.size.height == 5
        wide_lines = plain(wide).splitlines()
        assert len(wide_lines) == 3 and "97%" in wide_lines[2] and "PCIe" in wide_lines[0]
        markup = narrow.render()
        assert isinstance(markup, str)
        assert "[$success]  5%" in markup  # light load
        assert "[$error] 97%" in markup  # heavy load (nvitop's thresholds)
        assert "[$error]88°" in markup and "[$warning]240/250W" in markup
        narrow.readings = ()
        narrow.problem = "no NVIDIA driver (NVML not found)"
        await pilot.pause()
        assert plain(narrow).splitlines() == ["GPUs", "no NVIDIA driver (NVML not found)"]
        narrow.problem = (
            "no GPU readings: NVML did not start (NVML Shared Library Not Found); is the NVIDIA driver loaded?"
        )
        await pilot.pause()
        shown = [strip.text.strip() for strip in narrow.render_lines(Region(0, 0, *narrow.size))]
        assert shown[0] == "GPUs" and " ".join(shown[1:]) == narrow.problem  # every line of it, none cut off


@pytest.mark.asyncio
async def test_eight_gpus_fit_in_80_by_24(make_app):
    from tests.tui.fakes import ScriptedModel
    from tests.tui.helpers import ready

    app = make_app(ScriptedModel(), gpus=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: len(app.gpu_readings) == 8)
        await pilot.press("f3")
        await pilot.pause()
        panel = app.screen.query_one(GpuPanel)
        await pilot.pause()
        lines = plain(panel).splitlines()
        assert len(lines) == 9 and max(len(line) for line in lines) <= 76  # a header, then one line per GPU
        assert panel.region.bottom <= 24


@pytest.mark.gpu
def test_real_nvml_reads_every_gpu():
    sampler = open_nvml_sampler()
    assert sampler.problem is None, sampler.problem
    readings = sampler.read()
    sampler.close()
    assert readings and all(r.memory_total and r.memory_total > 0 for r in readings)
    assert all(r.utilization is not None and 0 <= r.utilization <= 100 for r in readings)
    assert all(r.temperature is None or 0 < r.temperature < 120 for r in readings)
