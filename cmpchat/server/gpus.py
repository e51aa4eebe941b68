"""`GET /v1/cmpchat/gpus`: the machine's GPUs as NVML reads them, and the pipeline stage each one holds, for front
ends on other machines (the app's remote mode). Behind the API key like every route but /health; readings start
with the first request and are then taken every second on a background thread, so a request never waits on NVML
(but the first, which waits for the first reading).

The response, always 200:

    {
      "object": "cmpchat.gpus",
      "problem": null,            # or one line saying why there are no readings (no NVML, no driver, no GPU)
      "sampled_at": 1764646800.5, # Unix time of the readings, null when there are none
      "gpus": [
        {
          "index": 0,                       # NVML's index
          "name": "NVIDIA CMP 100-210",
          "utilization": 97.0,              # percent of time a kernel ran
          "memory_used": 15032385536,       # bytes, every process
          "memory_total": 17179869184,
          "memory_cmpchat": 12884901888,    # bytes this server holds
          "temperature": 71,                # degrees Celsius
          "power": 182.0, "power_limit": 250.0,           # watts
          "sm_clock": 1380, "memory_clock": 877,          # MHz
          "fan": null,                      # percent; null on passively cooled cards
          "pcie_generation": 1, "pcie_width": 1,          # the link now
          "pcie_rx": 2097152.0, "pcie_tx": 524288.0,      # bytes per second into and out of the GPU
          "throttle_reasons": ["sw_power_cap"],           # [] when nothing holds the clocks down
          "uuid": "GPU-5c1f…",              # the card, however NVML and CUDA number the cards
          "stages": [{"stage": 0, "first_layer": 0, "last_layer": 15}],
          "activity": "decode"
        }
      ]
    }

Every reading is null when the driver does not report it (mining cards refuse several). `throttle_reasons` uses
`cmpchat.gpu_readings.THROTTLE_REASONS`' names. `stages` lists the pipeline stages on the GPU, with their layers
(inclusive); it is [] on a GPU the model does not use, and null while the model loads or when the backend has no
stages (the CPU reference). `activity` is null where `stages` is null or []; otherwise "idle", "prefill",
"decode" or "prefill+decode": what the engine's requests are doing, as the server reads their events (every stage
takes part in each engine step, so all of a model's GPUs show the same). Stages are matched to readings by the
cards' uuids (NVML's and CUDA's indices differ under `CUDA_VISIBLE_DEVICES` or without
`CUDA_DEVICE_ORDER=PCI_BUS_ID`), by index only where a uuid is unknown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cmpchat.api import Model
from cmpchat.gpu_readings import GpuMonitor, GpuReading, GpuSampler, GpuStage, stages_of
from cmpchat.gpu_readings import activity as engine_activity
from cmpchat.server.runtime import Runtime
from cmpchat.server.slots import SlotHolder

SAMPLE_SECONDS = 1.0
FIRST_READING_SECONDS = 5.0
"""How long the first request waits for the first reading before it answers without one."""


class GpuReadings:
    """The latest readings of `open_sampler()`'s sampler, taken on a monitor thread that the first call to `latest`
    starts (a server nobody asks never opens NVML)."""

    def __init__(self, open_sampler: Callable[[], GpuSampler], interval: float = SAMPLE_SECONDS) -> None:
        self._open_sampler = open_sampler
        self._interval = interval
        self._lock = threading.Lock()
        self._monitor: GpuMonitor | None = None
        self._closed = False
        self._first = threading.Event()
        self._latest: tuple[list[GpuReading], float | None] = ([], None)

    def latest(self) -> tuple[list[GpuReading], float | None, str | None]:
        """The readings, their Unix time and the sampler's problem. Blocks while the sampler opens (NVML can take
        a while to start) and until the first reading: call it from a worker thread."""
        with self._lock:
            if self._closed:
                return [], None, "the server is shutting down"
            if self._monitor is None:
                sampler = self._open_sampler()
                self._monitor = GpuMonitor(sampler, self._store, self._interval)
                self._monitor.start()
                if sampler.problem is not None:
                    self._first.set()
            monitor = self._monitor
        if not self._first.wait(FIRST_READING_SECONDS):
            return [], None, "the first GPU reading is not in yet; try again shortly"
        readings, sampled_at = self._latest
        return readings, sampled_at, monitor.sampler.problem

    def _store(self, readings: list[GpuReading]) -> None:
        self._latest = (readings, time.time())  # one assignment: readers see the old pair or the new one
        self._first.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            monitor = self._monitor
        if monitor is not None:
            monitor.stop()


def activity(holders: Sequence[SlotHolder | None]) -> str:
    """What the requests holding slots are doing: "idle", "prefill", "decode" or "prefill+decode"."""
    return engine_activity(holder.decoding for holder in holders if holder is not None)


def model_stages(model: Model | None) -> list[GpuStage] | None:
    """The pipeline stages and their GPUs; None while loading or when the backend has no stages."""
    return None if model is None else model.gpu_stages()


def gpu_json(reading: GpuReading, stages: list[GpuStage] | None, work: str) -> dict[str, Any]:
    """A reading with the stages its GPU holds (`gpu_readings.stages_of`: by uuid where both know it)."""
    body = asdict(reading)
    held = None
    if stages is not None:
        held = [
            {"stage": s.stage, "first_layer": s.layers.start, "last_layer": s.layers.stop - 1}
            for s in stages_of(reading, stages)
        ]
    body["stages"] = held
    body["activity"] = work if held else None
    return body


async def gpus(request: Request) -> Response:
    runtime: Runtime = request.app.state.runtime
    source: GpuReadings = request.app.state.gpu_readings
    readings, sampled_at, problem = await anyio.to_thread.run_sync(source.latest)
    stages = model_stages(runtime.model)
    work = activity(runtime.slots.holders())
    return JSONResponse(
        {
            "object": "cmpchat.gpus",
            "problem": problem,
            "sampled_at": sampled_at,
            "gpus": [gpu_json(reading, stages, work) for reading in readings],
        }
    )


def gpu_routes() -> list[Route]:
    return [Route("/v1/cmpchat/gpus", gpus, methods=["GET"])]
