"""A third-party-style OpenAI server for the app's remote-mode tests: /v1/models (any other GET is a 404,
as llama-server and vLLM answer cmpchat's own routes) and a streamed /v1/chat/completions whose chunks a
test writes, with `reasoning_content`, `usage` and no `timings` (as vLLM or a proxy sends them), a gate to
hold the stream mid-reply, a stream cut off without its end, and a 401 for a wrong key."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One chat-completion chunk with one choice."""
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "model": "stub-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


@dataclass
class StubScript:
    """What the stub answers. `hold_after` chunks are sent before it waits for `gate`; with `cut`, the
    connection is closed after the chunks, with no end of body and no [DONE]."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    api_key: str | None = None
    hold_after: int | None = None
    gate: threading.Event = field(default_factory=threading.Event)
    cut: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Each chat request's body, with the Authorization header it came with under "authorization"."""
    gets: list[str] = field(default_factory=list)
    """The path of each GET request, in order."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked bodies, so a cut stream is a broken body, not a short one
    script: StubScript

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _refused(self) -> bool:
        key = self.script.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._json(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})
        return True

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")  # no kept-alive connection outlives a stopped stub
        self.end_headers()
        self.close_connection = True
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.script.gets.append(self.path)
        if self.path != "/v1/models":
            self._json(404, {"error": {"message": "not found"}})
        elif not self._refused():
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": "not found"}})
            return
        self.script.requests.append({**body, "authorization": self.headers.get("Authorization")})
        if self._refused():
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index, event in enumerate(self.script.chunks):
            if index == self.script.hold_after:
                self.script.gate.wait(10)
            self._send_piece(f"data: {json.dumps(event)}\n\n")
        if self.script.cut:
            self.close_connection = True
            return
        self._send_piece("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def _send_piece(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@contextmanager
def openai_stub(script: StubScript) -> Iterator[str]:
    """Serve `script` on a free loopback port; yields the API's base URL (…/v1)."""
    handler = type("StubHandler", (_Handler,), {"script": script})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="openai-stub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        script.gate.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
