"""Listening: bind the socket ourselves (a clear error for a busy port, port 0 for tests), run uvicorn on it.

Stopping (SIGTERM, Ctrl+C): uvicorn stops accepting connections and waits for the requests in flight. Those get
`shutdown_grace_seconds` to finish; then the engine is stopped, which ends the rest as cancelled, so each still
gets its answer (a JSON 503, or a stream's error event and `[DONE]`) before uvicorn cuts what is left.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import socket

import uvicorn
from starlette.applications import Starlette

from cmpchat.errors import CmpchatError
from cmpchat.server.runtime import Runtime

ANSWER_SECONDS = 2.0
"""After the grace period, how long the ended requests' answers may take to go out before connections are cut."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle's algorithm off only on accepted sockets whose proto does,
    # and with it on, every response after the first on a kept-alive connection waits ~40 ms for an ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError as err:
        sock.close()
        raise CmpchatError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def make_server(app: Starlette, *, log_level: str = "info", access_log: bool = True) -> uvicorn.Server:
    """A uvicorn server for an app from `create_app`."""
    runtime: Runtime = app.state.runtime
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(runtime.settings.shutdown_grace_seconds + ANSWER_SECONDS),
    )
    return _Server(config, runtime)


class _Server(uvicorn.Server):
    """uvicorn's server, which ends the requests still in flight when the grace period is over."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self._runtime = runtime

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ending = asyncio.create_task(self._end_requests())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def _end_requests(self) -> None:
        await asyncio.sleep(self._runtime.settings.shutdown_grace_seconds)
        await asyncio.to_thread(self._runtime.close)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
