"""The GPU panel in remote mode: a live `cmpchat serve` on loopback (fake GPUs on the server's side, behind its
API key) fills the panel and the full-screen GPU list; a third-party-style server (a 404 for the endpoint) and
a server that went away, and a server's own "no GPUs" are one line in the panel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from cmpchat.backends.base import StageSummary
from cmpchat.gpu_readings import FakeGpuSampler, GpuStage, UnavailableSampler
from cmpchat.server.settings import ServerSettings
from cmpchat.tui.remote_model import RemoteServer
from cmpchat.tui.server_gpus import reading_from_json, stages_from_json
from cmpchat.tui.widgets.gpu_panel import GpuPanel
from tests.server.conftest import scripted_model
from tests.server.live import LiveServer, live_server
from tests.tui.helpers import plain, ready, wait_for
from tests.tui.openai_stub import StubScript, openai_stub
from tests.tui.test_tui_remote import remote_app

SERVER_KEY = "gpu-test-key"
SERVER_GPU = "NVIDIA CMP 100-210 (on the server)"


@pytest.fixture(scope="module")
def gpu_server(tiny_model_path: Path) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path)
    settings = ServerSettings(port=0, slots=1, model_name="scripted", api_key=SERVER_KEY)
    with live_server(settings, lambda: model, open_gpu_sampler=lambda: FakeGpuSampler(3, name=SERVER_GPU)) as server:
        yield server


def test_a_reading_keeps_the_fields_the_app_knows_and_drops_the_rest():
    reading = reading_from_json(
        {"index": 2, "name": "CMP", "throttle_reasons": ["idle"], "stages": [], "activity": None, "later": 1}
    )
    assert reading.index == 2 and reading.throttle_reasons == ("idle",) and reading.utilization is None


def test_the_stages_on_a_gpu_come_with_the_servers_activity():
    gpu = {
        "index": 1,
        "name": "CMP",
        "uuid": "GPU-b",
        "stages": [
            {"stage": 1, "first_layer": 16, "last_layer": 31},
            {"stage": 2, "first_layer": 32, "last_layer": 47},
        ],
        "activity": "prefill",
    }
    assert stages_from_json(gpu) == [
        GpuStage(1, "GPU-b", 1, range(16, 32), "prefill"),
        GpuStage(1, "GPU-b", 2, range(32, 48), "prefill"),
    ]
    assert stages_from_json({"index": 0, "name": "CMP", "stages": [], "activity": None}) == []  # not used
    assert stages_from_json({"index": 0, "name": "CMP", "stages": None, "activity": None}) == []  # loading
    assert stages_from_json({"index": 0, "name": "CMP"}) == []  # a server from before stages


@pytest.mark.asyncio
async def test_the_panel_shows_the_stages_a_servers_gpus_hold(tmp_path, tiny_model_path):
    model = scripted_model(tiny_model_path)
    model.backend.stage_summaries = lambda: [  # type: ignore[method-assign]
        StageSummary(0, 0, "", range(0, 2), 0, 0),
        StageSummary(1, 2, "", range(2, 4), 0, 0),
    ]
    settings = ServerSettings(port=0, slots=1, model_name="staged")
    with live_server(settings, lambda: model, open_gpu_sampler=lambda: FakeGpuSampler(3)) as server:
        app = remote_app(tmp_path, server.api)
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await ready(pilot)
            await wait_for(pilot, lambda: len(app.gpu_stages) == 2, what="the server's stages")
            assert app.gpu_stages == (
                GpuStage(0, None, 0, range(0, 2), "idle"),
                GpuStage(2, None, 1, range(2, 4), "idle"),
            )
            await pilot.pause()
            lines = plain(screen.query_one(GpuPanel)).splitlines()
            assert lines[3] == "  s0 L0-1 idle" and lines[4].startswith("1 ") and lines[8] == "  s1 L2-3 idle"


@pytest.mark.asyncio
async def test_the_panel_shows_the_servers_gpus_read_with_its_key(tmp_path, gpu_server):
    app = remote_app(tmp_path, gpu_server.api, SERVER_KEY)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await ready(pilot)
        await wait_for(pilot, lambda: len(app.gpu_readings) == 3, what="the server's readings")
        assert {r.name for r in app.gpu_readings} == {SERVER_GPU} and app.gpu_problem is None
        first = app.gpu_readings
        await wait_for(pilot, lambda: app.gpu_readings != first, what="a later reading (it polls)")
        panel = screen.query_one(GpuPanel)
        await pilot.pause()
        lines = plain(panel).splitlines()
        assert lines[0] == "GPUs" and len(lines) == 1 + 2 * 3 and lines[1].startswith("0 ")
        await pilot.press("f3")
        await wait_for(pilot, lambda: app.screen.query(GpuPanel), what="the GPU list")
        await pilot.pause()
        assert len(plain(app.screen.query_one(GpuPanel)).splitlines()) == 1 + 3  # a header, a line per GPU


@pytest.mark.asyncio
async def test_a_servers_own_problem_is_its_line_in_the_panel(tmp_path, tiny_model_path):
    model = scripted_model(tiny_model_path)
    no_nvml = "no GPU readings: nvidia-ml-py is not installed"
    settings = ServerSettings(port=0, slots=1, model_name="scripted")
    with live_server(settings, lambda: model, open_gpu_sampler=lambda: UnavailableSampler(no_nvml)) as server:
        app = remote_app(tmp_path, server.api)
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await ready(pilot)
            address = RemoteServer(server.api).address
            await wait_for(pilot, lambda: app.gpu_problem is not None, what="the server's answer")
            assert app.gpu_problem == f"{address}: {no_nvml}"
            await pilot.pause()
            assert " ".join(plain(screen.query_one(GpuPanel)).split()) == f"GPUs {app.gpu_problem}"


@pytest.mark.asyncio
async def test_a_server_without_the_endpoint_says_so_in_one_line_and_is_asked_once(tmp_path):
    script = StubScript()
    with openai_stub(script) as url:
        app = remote_app(tmp_path, url)
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await ready(pilot)
            await wait_for(pilot, lambda: app.gpu_problem is not None, what="the 404")
            address = RemoteServer(url).address
            assert app.gpu_problem == f"{address} gives no GPU readings (not a cmpchat server)"
            await pilot.pause()
            shown = plain(screen.query_one(GpuPanel)).splitlines()
            assert shown == ["GPUs", app.gpu_problem] and not app.gpu_readings
            await pilot.pause(1.2)  # more than two of the panel's intervals
            assert script.gets.count("/v1/cmpchat/gpus") == 1


@pytest.mark.asyncio
async def test_a_server_gone_after_connecting_is_one_line_in_the_panel(tmp_path, tiny_model_path):
    model = scripted_model(tiny_model_path)
    settings = ServerSettings(port=0, slots=1, model_name="scripted")
    with ExitStack() as running:
        server = running.enter_context(live_server(settings, lambda: model, open_gpu_sampler=FakeGpuSampler))
        app = remote_app(tmp_path, server.api)
        async with app.run_test(size=(160, 48)) as pilot:
            await ready(pilot)
            await wait_for(pilot, lambda: app.gpu_readings, what="the server's readings")
            running.close()  # the server stops: nothing listens at the address any more
            await wait_for(pilot, lambda: app.gpu_problem is not None, what="the failure")
            problem = app.gpu_problem or ""
            assert problem.startswith(f"no GPU readings from {RemoteServer(server.api).address}: ")
            assert "connection failed" in problem and not app.gpu_readings
