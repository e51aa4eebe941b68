"""Serving one generation, whatever the API: submit it, then stream its events as the API's server-sent events, or
wait for the end and answer one JSON body. Each API brings a `StreamWriter` (events to SSE text) and a body builder.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cmpchat.engine.request import EngineEvent
from cmpchat.server.errors import ApiError
from cmpchat.server.prepare import PreparedRequest
from cmpchat.server.responses import Outcome
from cmpchat.server.runtime import RequestStream, Runtime

log = logging.getLogger("cmpchat.server")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamWriter(Protocol):
    """The server-sent events of one streamed response, from the request's engine event batches."""

    def opening(self) -> list[str]:
        """What goes out before the first engine event."""
        ...

    def feed(self, events: Sequence[EngineEvent]) -> list[str]:
        """What these events make; after the last one (`Finished` or `Failed`), the closing events too."""
        ...

    def broken(self) -> list[str]:
        """The end of a stream that an unexpected server error cut short."""
        ...


async def serve(
    request: Request,
    runtime: Runtime,
    prepared: PreparedRequest,
    writer: Callable[[Outcome], StreamWriter],
    body: Callable[[Outcome], dict[str, Any]],
) -> Response:
    """Submit `prepared`; stream it through `writer(outcome)` or answer `body(outcome)` once it is done."""
    stream = runtime.open(prepared.generation)
    asked = prepared.generation.options.logprobs is not None
    outcome = Outcome(prepared.prompt_tokens, logprobs=[] if asked else None)
    if prepared.stream:
        events = _event_stream(stream, writer(outcome))
        return StreamingResponse(events, media_type="text/event-stream", headers=STREAM_HEADERS)
    await _wait_for(request, stream, outcome)
    if not outcome.done:
        return Response(status_code=499)  # the client went away; nobody reads this
    error = outcome.error()
    if error is not None:
        raise ApiError(*error)
    return JSONResponse(body(outcome))


async def _wait_for(request: Request, stream: RequestStream, outcome: Outcome) -> None:
    """Gather the request's events; if the client disconnects first, cancel the generation."""

    async def watch_disconnect(cancel_scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(watch_disconnect, group.cancel_scope)
            async for events in stream.batches():
                for event in events:
                    outcome.absorb(event)
            group.cancel_scope.cancel()
    finally:
        stream.cancel()


async def _event_stream(stream: RequestStream, writer: StreamWriter) -> AsyncIterator[str]:
    # Starlette cancels this generator when the client disconnects; `finally` then frees the slot.
    try:
        for chunk in writer.opening():
            yield chunk
        async for events in stream.batches():
            for chunk in writer.feed(events):
                yield chunk
    except Exception:
        log.exception("streaming a response failed")
        for chunk in writer.broken():
            yield chunk
    finally:
        stream.cancel()
