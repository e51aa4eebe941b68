"""A real server on 127.0.0.1 (a free port) in a background thread, for tests and the load generator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel

from cmpchat.api import Model
from cmpchat.gpu_readings import GpuSampler, UnavailableSampler
from cmpchat.server.app import create_app
from cmpchat.server.runner import address_of, bind, make_server
from cmpchat.server.settings import ServerSettings


@dataclass
class LiveServer:
    url: str
    """Base URL, e.g. http://127.0.0.1:41234"""
    load_failures: list[str]
    model: Model | None = None
    """The served model, when the test that started the server wants to look at it."""

    @property
    def api(self) -> str:
        return self.url + "/v1"

    @property
    def served(self) -> Model:
        """`model`, for a test whose server fixture set it."""
        assert self.model is not None, "this server's fixture did not record its model"
        return self.model


def extra(reply: BaseModel) -> dict[str, Any]:
    """The fields of an openai client object beyond OpenAI's own (cmpchat's `timings`, `reasoning_content`)."""
    assert reply.model_extra is not None
    return reply.model_extra


@contextmanager
def live_server(
    settings: ServerSettings,
    load: Callable[[], Model],
    *,
    wait_ready: bool = True,
    open_gpu_sampler: Callable[[], GpuSampler] = lambda: UnavailableSampler("no GPU readings in these tests"),
) -> Iterator[LiveServer]:
    failures: list[str] = []
    app = create_app(settings, load, on_load_failure=failures.append, open_gpu_sampler=open_gpu_sampler)
    sock = bind("127.0.0.1", 0)
    server = make_server(app, log_level="warning", access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    live = LiveServer(address_of(sock), failures)
    try:
        wait_for(lambda: server.started, "the server to start")
        if wait_ready:
            wait_for(lambda: httpx.get(live.url + "/health").status_code == 200, "the model to load")
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """One unlabelled sample from /metrics."""
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
