"""`GET /v1/cmpchat/gpus`: the GPU readings and the stage each GPU holds, from a fixed sampler and stages set on the
scripted backend as the CUDA backend has them; the API key; no GPU, and a sampler that breaks, as a `problem`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cmpchat.backends.base import StageSummary
from cmpchat.engine.reply import GenerationOptions
from cmpchat.gpu_readings import GpuReading, UnavailableSampler
from cmpchat.server.gpus import activity
from cmpchat.server.settings import ServerSettings
from cmpchat.server.slots import SlotHolder
from tests.scripted_backend import FOREVER
from tests.server.conftest import API_KEY, scripted_model
from tests.server.live import LiveServer, live_server, wait_for

GIB = 2**30
PATH = "/v1/cmpchat/gpus"
BUSY = GpuReading(
    index=0,
    name="NVIDIA CMP 100-210",
    utilization=97.0,
    memory_used=14 * GIB,
    memory_total=16 * GIB,
    temperature=71,
    power=182.0,
    power_limit=250.0,
    pcie_rx=2.0 * 2**20,
    pcie_tx=0.5 * 2**20,
    memory_cmpchat=12 * GIB,
    sm_clock=1380,
    memory_clock=877,
    fan=None,
    pcie_generation=1,
    pcie_width=1,
    throttle_reasons=("sw_power_cap", "hw_thermal"),
)
SPARE = GpuReading(index=1, name="NVIDIA CMP 100-210")
"""A GPU that the model does not use and whose driver reports nothing but its name."""


class FixedSampler:
    """The same readings every time; counts its reads."""

    def __init__(self, readings: list[GpuReading]) -> None:
        self.problem: str | None = None
        self.readings = readings
        self.reads = 0
        self.closed = False

    def read(self) -> list[GpuReading]:
        self.reads += 1
        return self.readings

    def close(self) -> None:
        self.closed = True


class BrokenSampler(FixedSampler):
    def read(self) -> list[GpuReading]:
        raise RuntimeError("GPU has fallen off the bus")


def stage(index: int, gpu: int, layers: range, uuid: str = "") -> StageSummary:
    """A pipeline stage as the GPU backend summarises it."""
    return StageSummary(index, gpu, uuid, layers, 0, 0)


def test_stages_are_matched_to_readings_by_the_cards_uuid_where_known() -> None:
    from cmpchat.gpu_readings import GpuStage
    from cmpchat.server.gpus import gpu_json

    # CUDA's GPU 0 is NVML's GPU 1 (CUDA_VISIBLE_DEVICES=1): the uuid, not the index, tells them apart.
    stages = [GpuStage(0, "GPU-b", 0, range(0, 4), "idle")]
    nvml_0 = gpu_json(GpuReading(index=0, name="CMP", uuid="GPU-a"), stages, "idle")
    nvml_1 = gpu_json(GpuReading(index=1, name="CMP", uuid="GPU-b"), stages, "idle")
    assert nvml_0["stages"] == [] and nvml_0["activity"] is None
    assert nvml_1["stages"] == [{"stage": 0, "first_layer": 0, "last_layer": 3}] and nvml_1["activity"] == "idle"


def gpus(server: LiveServer, headers: dict[str, str] | None = None) -> dict:
    response = httpx.get(server.url + PATH, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def sampler() -> FixedSampler:
    return FixedSampler([BUSY, SPARE])


@pytest.fixture(scope="module")
def gpu_server(tiny_model_path: Path, sampler: FixedSampler) -> Iterator[LiveServer]:
    model = scripted_model(tiny_model_path, step_delay=0.005)
    model.backend.stage_summaries = lambda: [stage(0, 0, range(0, 2)), stage(1, 0, range(2, 4))]  # type: ignore[method-assign]
    settings = ServerSettings(port=0, slots=2, model_name="staged", api_key=API_KEY)
    with live_server(settings, lambda: model, open_gpu_sampler=lambda: sampler) as server:
        yield server
    assert sampler.closed  # the monitor stops with the server


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_every_reading_and_the_stages_each_gpu_holds(gpu_server: LiveServer) -> None:
    body = gpus(gpu_server, AUTH)
    assert body["object"] == "cmpchat.gpus" and body["problem"] is None
    assert isinstance(body["sampled_at"], float)
    busy, spare = body["gpus"]
    assert busy == {
        "index": 0,
        "name": "NVIDIA CMP 100-210",
        "utilization": 97.0,
        "memory_used": 14 * GIB,
        "memory_total": 16 * GIB,
        "memory_cmpchat": 12 * GIB,
        "temperature": 71,
        "power": 182.0,
        "power_limit": 250.0,
        "sm_clock": 1380,
        "memory_clock": 877,
        "fan": None,
        "pcie_generation": 1,
        "pcie_width": 1,
        "pcie_rx": 2.0 * 2**20,
        "pcie_tx": 0.5 * 2**20,
        "throttle_reasons": ["sw_power_cap", "hw_thermal"],
        "uuid": None,
        "stages": [{"stage": 0, "first_layer": 0, "last_layer": 1}, {"stage": 1, "first_layer": 2, "last_layer": 3}],
        "activity": "idle",
    }
    assert spare["index"] == 1 and spare["stages"] == [] and spare["activity"] is None
    assert all(spare[key] is None for key in busy if key not in ("index", "name", "stages", "activity"))


def test_the_readings_come_from_the_monitor_not_the_request(gpu_server: LiveServer, sampler: FixedSampler) -> None:
    gpus(gpu_server, AUTH)
    reads = sampler.reads
    for _ in range(5):
        gpus(gpu_server, AUTH)
    assert sampler.reads <= reads + 1  # one a second at most, however often it is asked


def test_a_decoding_request_shows_on_the_gpus_that_hold_its_stages(gpu_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "SAY:" + FOREVER}], "max_tokens": 100_000, "stream": True}
    with httpx.Client(timeout=30, headers=AUTH) as http:
        stream = http.send(http.build_request("POST", gpu_server.api + "/chat/completions", json=body), stream=True)
        wait_for(lambda: gpus(gpu_server, AUTH)["gpus"][0]["activity"] == "decode", "the request to decode")
        assert gpus(gpu_server, AUTH)["gpus"][1]["activity"] is None
        stream.close()
    wait_for(lambda: gpus(gpu_server, AUTH)["gpus"][0]["activity"] == "idle", "the slot to be free")


def test_the_readings_need_the_api_key(gpu_server: LiveServer) -> None:
    response = httpx.get(gpu_server.url + PATH)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert gpus(gpu_server, {"X-Api-Key": API_KEY})["gpus"][0]["index"] == 0
    assert httpx.get(gpu_server.url + "/health").status_code == 200


def test_activity_of_the_slots() -> None:
    def holder(*, decoding: bool) -> SlotHolder:
        return SlotHolder(1, GenerationOptions(), decoding=decoding)

    assert activity([None, None]) == "idle"
    assert activity([holder(decoding=False), None]) == "prefill"
    assert activity([holder(decoding=True), holder(decoding=True)]) == "decode"
    assert activity([holder(decoding=True), holder(decoding=False)]) == "prefill+decode"


def test_no_gpu_is_a_problem_not_an_error(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    no_nvml = "no GPU readings: NVML did not start (NVML Shared Library Not Found); is the NVIDIA driver loaded?"
    with live_server(ServerSettings(port=0), lambda: model, open_gpu_sampler=lambda: UnavailableSampler(no_nvml)) as s:
        assert gpus(s) == {"object": "cmpchat.gpus", "problem": no_nvml, "sampled_at": None, "gpus": []}
    with live_server(ServerSettings(port=0), lambda: model, open_gpu_sampler=lambda: BrokenSampler([])) as s:
        body = gpus(s)
        assert body["gpus"] == [] and body["problem"] == "readings stopped: GPU has fallen off the bus"


def test_readings_while_the_model_loads_have_no_stages(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)
    model.backend.stage_summaries = lambda: [stage(0, 0, range(0, 4))]  # type: ignore[method-assign]
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return model

    opened: list[FixedSampler] = []

    def open_sampler() -> FixedSampler:
        opened.append(FixedSampler([BUSY]))
        return opened[-1]

    with live_server(ServerSettings(port=0), load, wait_ready=False, open_gpu_sampler=open_sampler) as server:
        assert not opened  # nothing opens NVML before someone asks
        (loading,) = gpus(server)["gpus"]
        assert loading["stages"] is None and loading["activity"] is None and loading["utilization"] == 97.0
        loaded.set()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, "the model to load")
        (ready,) = gpus(server)["gpus"]
        assert ready["stages"] == [{"stage": 0, "first_layer": 0, "last_layer": 3}] and ready["activity"] == "idle"
        assert len(opened) == 1


def test_a_backend_without_stages_gives_null_stages(tiny_model_path: Path) -> None:
    model = scripted_model(tiny_model_path)  # as the numpy reference: no `stages`
    with live_server(ServerSettings(port=0), lambda: model, open_gpu_sampler=lambda: FixedSampler([BUSY])) as server:
        (reading,) = gpus(server)["gpus"]
        assert reading["stages"] is None and reading["activity"] is None and reading["sm_clock"] == 1380
