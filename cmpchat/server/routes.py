"""The HTTP endpoints: health, models, chat completions, completions, metrics, llama-server's own
(`llama_endpoints`), OpenAI's Responses API (`openai_responses`), Anthropic's Messages API
(`anthropic_messages`) and cmpchat's GPU readings (`gpus`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from cmpchat.api import Model
from cmpchat.server.anthropic_messages import messages_routes
from cmpchat.server.errors import error_body
from cmpchat.server.generation import serve
from cmpchat.server.gpus import gpu_routes
from cmpchat.server.guard import read_json
from cmpchat.server.llama_endpoints import llama_routes
from cmpchat.server.logprobs import LogprobShapes
from cmpchat.server.metrics import CONTENT_TYPE, render_metrics
from cmpchat.server.openai_responses import responses_routes
from cmpchat.server.prepare import PreparedRequest, prepare_chat, prepare_completion
from cmpchat.server.responses import (
    ChunkWriter,
    Kind,
    ResponseHeader,
    chat_completion_body,
    text_completion_body,
)
from cmpchat.server.runtime import LoadState, Runtime
from cmpchat.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from cmpchat.server.settings import ServerSettings

BodyT = TypeVar("BodyT", bound=BaseModel)


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
    header = ResponseHeader(kind, runtime.model_name)
    build = chat_completion_body if kind == "chat" else text_completion_body
    shapes = LogprobShapes(model.tokenizer)
    return await serve(
        request,
        runtime,
        prepared,
        lambda outcome: ChunkWriter(header, outcome, shapes, include_usage=prepared.include_usage),
        lambda outcome: build(header, outcome, shapes),
    )


def routes() -> list[Route]:
    table: list[Route] = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *llama_routes(),
        *gpu_routes(),
        *responses_routes(),
        *messages_routes(),
    ]
    # llama-server answers with and without the /v1 prefix; so do we.
    for prefix in ("/v1", ""):
        table += [
            Route(f"{prefix}/models", models, methods=["GET"]),
            Route(f"{prefix}/chat/completions", chat_completions, methods=["POST"]),
            Route(f"{prefix}/completions", completions, methods=["POST"]),
        ]
    return table
