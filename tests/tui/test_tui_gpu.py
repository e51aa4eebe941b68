"""The GPU panel and the status bar's summary, fed by the fake sampler (the readings themselves:
tests/test_gpu_readings.py)."""

from __future__ import annotations

import pytest
from textual.geometry import Region

from cmpchat.gpu_readings import FakeGpuSampler, GpuReading
from cmpchat.tui.widgets.gpu_panel import GpuPanel, summary
from tests.tui.helpers import plain, wait_for

GIB = 2**30


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
