"""The GPU panel and the status bar's summary, fed by the fake sampler (the readings themselves:
tests/test_gpu_readings.py)."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.geometry import Region

from cmpchat.gpu_readings import FakeGpuSampler, GpuReading, GpuStage
from cmpchat.tui.format import megabytes_per_second
from cmpchat.tui.widgets.gpu_panel import GpuPanel, short_name, spans, summary
from tests.tui.helpers import plain, wait_for

GIB = 2**30


def test_summary_for_the_status_bar():
    readings = tuple(FakeGpuSampler(3, busy=True).read())
    text = summary(readings)
    assert text.startswith("GPU ") and text.count("/") >= 3 and "GB" in text
    assert summary(()) == ""


@pytest.mark.asyncio
async def test_gpu_panel_layouts_and_colour_thresholds():
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
        assert len(wide_lines) == 2 + 2 * 2  # a two-line header, two lines per GPU
        assert "97%" in wide_lines[4] and "PCIe" in wide_lines[1] and "cmpchat" in wide_lines[0]
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
        assert len(lines) == 2 + 2 * 8 and max(len(line) for line in lines) <= 76  # a header, two lines a GPU
        assert [line.split()[0] for line in lines[2::2]] == [str(i) for i in range(8)]
        assert all("Gen1x1" in line for line in lines[3::2])
        assert panel.region.bottom <= 24


class Panels(App[None]):
    """The three forms at the widths they have in the app: the side column (33), the full-screen list at
    80 columns (76) and at 160 (156)."""

    CSS = "#narrow { width: 33; } #wide { width: 76; } #one { width: 156; }"

    def compose(self) -> ComposeResult:
        yield GpuPanel(id="narrow")
        yield GpuPanel(id="wide", title=False)
        yield GpuPanel(id="one", title=False)


async def show(pilot, readings, stages=()) -> dict[str, list[str]]:
    """What each panel shows, line by line, once it has `readings` and `stages`."""
    for panel in pilot.app.query(GpuPanel):
        panel.readings = tuple(readings)
        panel.stages = tuple(stages)
    await pilot.pause()
    return {str(panel.id): plain(panel).splitlines() for panel in pilot.app.query(GpuPanel)}


def stage_column(line: str) -> str:
    """The stage in a wide form's second line (the throttle reasons after it left out)."""
    return line.split("  ")[-1].split(" · ")[0]


def split(gpus: list[int], layers: int = 48, activity: str = "decode") -> list[GpuStage]:
    """`layers` layers in equal stages, stage i on GPU `gpus[i]`."""
    per = layers // len(gpus)
    return [GpuStage(gpu, None, i, range(i * per, (i + 1) * per), activity) for i, gpu in enumerate(gpus)]


@pytest.mark.asyncio
async def test_the_wide_forms_show_every_field_and_a_dash_for_what_the_driver_keeps():
    sampler = FakeGpuSampler(2)
    readings = sampler.read()
    bare = GpuReading(2, "NVIDIA GeForce RTX 4090")  # the driver reported its name alone
    async with Panels().run_test(size=(160, 40)) as pilot:
        shown = await show(pilot, [*readings, bare])
        wide, one = shown["wide"], shown["one"]
        assert len(wide) == 2 + 2 * 3 and len(one) == 1 + 3
        assert max(len(line) for line in wide) <= 76 and max(len(line) for line in one) <= 156
        assert wide[0].split() == "# name utilisation memory cmpchat temp fan power".split()
        assert wide[1].split() == "SM/mem MHz link PCIe rx/tx MB/s stage · throttle".split()
        first, second = wide[2], wide[3]
        assert first.startswith("0 CMP 100-210 ") and "NVIDIA" not in first
        assert "12.5/16.0G" in first and " 12.0G " in first  # every process's memory, then cmpchat's own
        assert first.split()[-2:] == ["–", f"{readings[0].power:.0f}/250W"]  # no fan on a mining card
        clocks = f"{readings[0].sm_clock}/877"
        rx = megabytes_per_second(readings[0].pcie_rx)
        assert second.split()[:4] == [clocks, "Gen1x1", "rx", rx]
        throttled = "pwr-cap" if readings[0].throttle_reasons else None
        assert second.endswith("– · pwr-cap" if throttled else " –")  # the stage is unknown
        bare_first, bare_second = wide[6].split(), wide[7].split()
        assert bare_first == ["2", "RTX", "4090", *"–% –/–G – –° – –W".split()]  # the sparkline holds a blank
        assert bare_second == "– – rx – tx – – · –".split()
        for line in (wide[2], wide[3]):
            assert line.strip() and line.split()[0] in one[1]  # the one-line form is the two lines side by side
        assert "Gen1x1" in one[1] and "12.0G" in one[1] and one[0].endswith("stage · throttle")


@pytest.mark.asyncio
async def test_the_stage_each_gpu_holds_and_what_the_engine_does():
    readings = FakeGpuSampler(3).read()
    async with Panels().run_test(size=(160, 50)) as pilot:
        # A 3-stage split over three GPUs, decoding: every GPU says which layers it holds.
        shown = await show(pilot, readings, split([0, 1, 2]))
        narrow = shown["narrow"]
        assert len(narrow) == 1 + 3 * 3 and narrow[3::3] == [
            "  s0 L0-15 decode",
            "  s1 L16-31 decode",
            "  s2 L32-47 decode",
        ]
        assert max(len(line) for line in narrow) <= 33
        assert [stage_column(line) for line in shown["wide"][3::2]] == [
            "s0 L0-15 decode",
            "s1 L16-31 decode",
            "s2 L32-47 decode",
        ]
        panel = pilot.app.query_one("#narrow", GpuPanel)
        assert "[$success]decode[/]" in str(panel.render())

        # One GPU holding the three stages, reading a prompt: the others hold none.
        shown = await show(pilot, readings, split([0, 0, 0], activity="prefill"))
        narrow = shown["narrow"]
        assert len(narrow) == 1 + 2 * 3 + 1 and narrow[3] == "  s0-2 L0-47 prefill"
        assert narrow[4].startswith("1 ") and narrow[6].startswith("2 ")  # no stage line where none is held
        assert [stage_column(line) for line in shown["wide"][3::2]] == ["s0-2 L0-47 prefill", "–", "–"]
        assert "[$warning]prefill[/]" in str(panel.render())

        # Stages 0 and 2 on GPU 0, stage 1 on GPU 1, idle.
        shown = await show(pilot, readings, split([0, 1, 0], activity="idle"))
        assert shown["narrow"][3] == "  s0,2 L0-15,32-47 idle" and shown["narrow"][6] == "  s1 L16-31 idle"
        assert "[$text-muted]idle[/]" in str(panel.render())


@pytest.mark.asyncio
async def test_stages_are_matched_to_readings_by_uuid_where_both_know_it():
    # CUDA's GPU 0 is NVML's GPU 1 (CUDA_VISIBLE_DEVICES=1,0): the uuid tells.
    readings = [GpuReading(0, "CMP", uuid="GPU-a"), GpuReading(1, "CMP", uuid="GPU-b")]
    stages = [GpuStage(0, "GPU-b", 0, range(0, 24), "decode"), GpuStage(1, "GPU-a", 1, range(24, 48), "decode")]
    async with Panels().run_test(size=(160, 40)) as pilot:
        narrow = (await show(pilot, readings, stages))["narrow"]
        assert narrow[3] == "  s1 L24-47 decode" and narrow[6] == "  s0 L0-23 decode"
        no_uuid = [GpuReading(0, "CMP"), GpuReading(1, "CMP")]  # then by index
        narrow = (await show(pilot, no_uuid, stages))["narrow"]
        assert narrow[3] == "  s0 L0-23 decode" and narrow[6] == "  s1 L24-47 decode"


@pytest.mark.asyncio
async def test_throttle_reasons_are_short_shown_only_when_any_and_cut_to_fit():
    every = ("idle", "sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake", "0x800")
    readings = [
        GpuReading(0, "CMP", throttle_reasons=()),
        GpuReading(1, "CMP", throttle_reasons=("sw_power_cap",)),
        GpuReading(2, "CMP", throttle_reasons=every),
        GpuReading(3, "CMP", throttle_reasons=("idle",)),
    ]
    stages = [GpuStage(gpu, None, 0, range(0, 48), "decode") for gpu in range(4)]
    async with Panels().run_test(size=(160, 40)) as pilot:
        shown = await show(pilot, readings, stages)
        wide = [line.split("  ")[-1] for line in shown["wide"][3::2]]
        assert wide[0] == "s0 L0-47 decode"  # nothing holds the clocks down: no reasons
        assert wide[1] == "s0 L0-47 decode · pwr-cap"
        assert wide[2] == "s0 L0-47 decode · hw-slow +6"  # the hardware's own brakes first, the rest counted
        assert wide[3] == "s0 L0-47 decode · idle"
        assert max(len(line) for line in shown["wide"]) <= 76
        assert shown["one"][3].endswith("s0 L0-47 decode · hw-slow hw-therm pwr-brake +4")  # more room, more
        markup = str(pilot.app.query_one("#wide", GpuPanel).render())
        assert "[$text-muted]idle[/]" in markup and "[$warning]pwr-cap[/]" in markup and "[$error]hw-slow[/]" in markup


@pytest.mark.asyncio
async def test_a_short_screen_drops_the_second_lines_before_any_gpu():
    class Short(App[None]):
        CSS = "#narrow { width: 33; height: auto; } #wide { width: 76; }"

        def compose(self) -> ComposeResult:
            with Horizontal():
                yield GpuPanel(id="narrow")
                yield GpuPanel(id="wide", title=False)

    readings = FakeGpuSampler(8).read()
    async with Short().run_test(size=(120, 16)) as pilot:
        shown = await show(pilot, readings, split([0, 1, 2, 3]))
        await pilot.pause()
        shown = {str(p.id): plain(p).splitlines() for p in pilot.app.query(GpuPanel)}
        assert len(shown["wide"]) == 1 + 8  # a header and each GPU's first line: 2 + 16 lines would not fit
        assert len(shown["narrow"]) == 1 + 2 * 8  # no stage lines: 1 + 16 + 4 would not fit either
        assert pilot.app.query_one("#wide", GpuPanel).region.bottom <= 16
    async with Short().run_test(size=(120, 40)) as pilot:
        shown = await show(pilot, readings, split([0, 1, 2, 3]))
        await pilot.pause()
        shown = {str(p.id): plain(p).splitlines() for p in pilot.app.query(GpuPanel)}
        assert len(shown["wide"]) == 2 + 2 * 8 and len(shown["narrow"]) == 1 + 2 * 8 + 4


def test_short_names_and_spans():
    assert short_name("NVIDIA CMP 100-210") == "CMP 100-210"
    assert short_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert short_name("Tesla V100-SXM2-16GB") == "V100-SXM2-1…"
    assert spans([range(16, 32), range(0, 16)]) == "0-31"
    assert spans([range(0, 16), range(32, 48)]) == "0-15,32-47"
    assert spans([range(3, 4)]) == "3"


@pytest.mark.asyncio
async def test_the_app_shows_the_stages_of_its_own_model(make_app):
    from tests.tui.fakes import ScriptedModel
    from tests.tui.helpers import ready

    stages = split([0, 1], layers=24, activity="idle")
    app = make_app(ScriptedModel(stages=stages), gpus=2)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        await wait_for(pilot, lambda: app.gpu_stages == tuple(stages), what="the model's stages")
        await pilot.pause()
        side = plain(screen.query_one("#gpus", GpuPanel)).splitlines()
        assert side[3] == "  s0 L0-11 idle" and side[6] == "  s1 L12-23 idle"
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.query(GpuPanel), what="the GPU list")
        await pilot.pause()
        full = plain(app.screen.query_one(GpuPanel)).splitlines()
        assert len(full) == 1 + 2  # the one-line form at 160 columns
        assert [stage_column(line) for line in full[1:]] == ["s0 L0-11 idle", "s1 L12-23 idle"]
