"""Listening: bind the socket ourselves (a clear error for a busy port, port 0 for tests), run uvicorn on it."""

from __future__ import annotations

import ipaddress
import socket

import uvicorn
from starlette.types import ASGIApp

from cmpchat.errors import CmpchatError

GRACEFUL_SHUTDOWN_SECONDS = 3
"""How long open streams may run on after Ctrl+C before they are cut (which cancels their generation)."""


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


def make_server(app: ASGIApp, *, log_level: str = "info", access_log: bool = True) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    return uvicorn.Server(config)


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
