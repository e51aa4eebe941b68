"""The GPU panel in remote mode: the server's own GPUs, from `GET /v1/cmpchat/gpus` (cmpchat serve's
endpoint; its schema is in `cmpchat/server/gpus.py`), read on a thread of its own at the panel's interval.

A server without the endpoint (llama-server, vLLM: a 404) is asked once; any other failure is shown as one
line and asked again at the next interval, so readings come back when the server does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import httpx

from cmpchat.gpu_readings import GpuReading, GpuStage
from cmpchat.tui.remote_model import RemoteServer, failure_reason, refusal

GPUS_PATH = "/cmpchat/gpus"
"""Under the API's base URL (…/v1)."""
REQUEST_SECONDS = 10.0
"""The server's first answer waits up to 5 s for its first reading (`FIRST_READING_SECONDS` there)."""
_FIELDS = {f.name for f in fields(GpuReading)}


@dataclass(frozen=True, slots=True)
class ServerGpuReport:
    """One answer: the readings and the pipeline stages on them, or the one line the panel shows instead;
    `final` when asking again is pointless (the server has no such endpoint)."""

    readings: tuple[GpuReading, ...] = ()
    stages: tuple[GpuStage, ...] = ()
    problem: str | None = None
    final: bool = False


def read_server_gpus(server: RemoteServer, client: httpx.Client) -> ServerGpuReport:
    """Ask the server for its GPU readings once."""
    try:
        response = client.get(server.url + GPUS_PATH, headers=server.headers())
    except httpx.HTTPError as err:
        return ServerGpuReport(problem=f"no GPU readings from {server.address}: {failure_reason(err)}")
    if response.status_code == 404:
        return ServerGpuReport(problem=f"{server.address} gives no GPU readings (not a cmpchat server)", final=True)
    if response.status_code != 200:
        return ServerGpuReport(problem=f"no GPU readings: {refusal(response)}")
    try:
        body = response.json()
        readings = tuple(reading_from_json(gpu) for gpu in body["gpus"])
        stages = tuple(stage for gpu in body["gpus"] for stage in stages_from_json(gpu))
    except (ValueError, KeyError, TypeError):
        return ServerGpuReport(problem=f"no GPU readings: {server.address} answered with something else")
    problem = body.get("problem")
    return ServerGpuReport(readings, stages, f"{server.address}: {problem}" if problem else None)


def reading_from_json(gpu: dict[str, Any]) -> GpuReading:
    """A `GpuReading` from one entry of the answer's `gpus`; its stages (`stages_from_json`) and any field a
    newer server adds are left out."""
    known = {name: value for name, value in gpu.items() if name in _FIELDS}
    if known.get("throttle_reasons") is not None:
        known["throttle_reasons"] = tuple(known["throttle_reasons"])
    return GpuReading(**known)


def stages_from_json(gpu: dict[str, Any]) -> list[GpuStage]:
    """The pipeline stages one entry of the answer's `gpus` holds, with the server's activity; none where the
    server says none or nothing (loading, a CPU backend, an older server). The stage takes the GPU's index and
    uuid as the server reads them, so it matches the reading beside it."""
    held = gpu.get("stages") or []
    work = gpu.get("activity") or "idle"
    return [
        GpuStage(
            gpu["index"], gpu.get("uuid"), stage["stage"], range(stage["first_layer"], stage["last_layer"] + 1), work
        )
        for stage in held
    ]


class ServerGpuPoller:
    """Reads the server's GPUs every `interval` seconds on a daemon thread and hands each report to
    `on_report` there (give it something thread-safe, such as `App.post_message`)."""

    def __init__(
        self, server: RemoteServer, on_report: Callable[[ServerGpuReport], None], interval: float = 1.0
    ) -> None:
        self.server = server
        self.interval = interval
        self._on_report = on_report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmpchat-server-gpus", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; it ends at once unless a request is under way (at most `REQUEST_SECONDS`),
        and as a daemon it never holds the process."""
        self._stop.set()

    def _run(self) -> None:
        with httpx.Client(timeout=REQUEST_SECONDS) as client:
            while not self._stop.is_set():
                report = read_server_gpus(self.server, client)
                if self._stop.is_set():
                    return  # stopped while the request was under way: the report is no longer wanted
                self._on_report(report)
                if report.final:
                    return
                self._stop.wait(self.interval)
