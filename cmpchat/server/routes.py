"""The HTTP endpoints: health, models, chat completions, completions, metrics, and llama-server's own
(`llama_endpoints`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from cmpchat.api import Model
from cmpchat.server.errors import ApiError, error_body
from cmpchat.server.guard import read_json
from cmpchat.server.llama_endpoints import llama_routes
from cmpchat.server.metrics import CONTENT_TYPE, render_metrics
from cmpchat.server.prepare import PreparedRequest, prepare_chat, prepare_completion
from cmpchat.server.responses import (
    ChunkWriter,
    Kind,
    Outcome,
    ResponseHeader,
    chat_completion_body,
    sse,
    text_completion_body,
)
from cmpchat.server.runtime import LoadState, RequestStream, Runtime
from cmpchat.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from cmpchat.server.settings import ServerSettings

log = logging.getLogger("cmpchat.server")

BodyT = TypeVar("BodyT", bound=BaseModel)

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def health(request: Request) -> Response:
    runtime = _runtime(request)
    if runtime.state is LoadState.READY:
        return JSONResponse({"status": "ok"})
    if runtime.state is LoadState.FAILED:
        body = error_body(503, f"the model failed to load: {runtime.error}")
    else:
        body = error_body(503, "the model is loading", code="model_loading")
    return JSONResponse({"status": runtime.state.value, **body}, status_code=503)


async def models(request: Request) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    entry = {
        "id": runtime.model_name,
        "object": "model",
        "created": runtime.created,
        "owned_by": "cmpchat",
        "meta": {
            "context_length": model.config.context_length,
            "vocab_size": model.config.vocab_size,
            "backend": model.backend.name,
            "slots": runtime.settings.slots,
        },
    }
    return JSONResponse({"object": "list", "data": [entry]})


async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    return PlainTextResponse(render_metrics(runtime.engine, slots=runtime.settings.slots), media_type=CONTENT_TYPE)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest, prepare_chat, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, CompletionRequest, prepare_completion, "text")


async def _generate(
    request: Request,
    schema: type[BodyT],
    prepare: Callable[[BodyT, Model, ServerSettings], PreparedRequest],
    kind: Kind,
) -> Response:
    runtime = _runtime(request)
    model, _ = runtime.ready()
    body = parse_body(schema, await read_json(request, runtime.settings.max_request_bytes))
    # Rendering and tokenizing a long conversation takes a while: keep it off the event loop.
    prepared = await anyio.to_thread.run_sync(prepare, body, model, runtime.settings)
    stream = runtime.open(prepared.generation)
    header = ResponseHeader(kind, runtime.model_name)
    outcome = Outcome(prepared.prompt_tokens)
    if prepared.stream:
        writer = ChunkWriter(header, outcome, include_usage=prepared.include_usage)
        return StreamingResponse(_event_stream(stream, writer), media_type="text/event-stream", headers=_STREAM_HEADERS)
    await _wait_for(request, stream, outcome)
    if not outcome.done:
        return Response(status_code=499)  # the client went away; nobody reads this
    error = outcome.error()
    if error is not None:
        raise ApiError(*error)
    build = chat_completion_body if kind == "chat" else text_completion_body
    return JSONResponse(build(header, outcome))


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


async def _event_stream(stream: RequestStream, writer: ChunkWriter) -> AsyncIterator[str]:
    # Starlette cancels this generator when the client disconnects; `finally` then frees the slot.
    try:
        for chunk in writer.opening():
            yield chunk
        async for events in stream.batches():
            for chunk in writer.feed(events):
                yield chunk
    except Exception:
        log.exception("streaming a response failed")
        yield sse(error_body(500, "internal server error while streaming; the server log has the details"))
        yield sse("[DONE]")
    finally:
        stream.cancel()


def routes() -> list[Route]:
    table: list[Route] = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *llama_routes(),
    ]
    # llama-server answers with and without the /v1 prefix; so do we.
    for prefix in ("/v1", ""):
        table += [
            Route(f"{prefix}/models", models, methods=["GET"]),
            Route(f"{prefix}/chat/completions", chat_completions, methods=["POST"]),
            Route(f"{prefix}/completions", completions, methods=["POST"]),
        ]
    return table
