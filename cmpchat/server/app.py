"""The ASGI application: routes, the API key and CORS layers, error handlers, and the model's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from cmpchat.errors import CmpchatError
from cmpchat.gpu_readings import GpuSampler, open_nvml_sampler
from cmpchat.server.errors import (
    ApiError,
    UnexpectedErrorMiddleware,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
    handle_user_error,
)
from cmpchat.server.gpus import GpuReadings
from cmpchat.server.guard import ApiKeyMiddleware
from cmpchat.server.routes import routes
from cmpchat.server.runtime import ModelLoader, Runtime
from cmpchat.server.settings import ServerSettings


def create_app(
    settings: ServerSettings,
    load: ModelLoader,
    *,
    on_load_failure: Callable[[str], None] | None = None,
    open_gpu_sampler: Callable[[], GpuSampler] = open_nvml_sampler,
) -> Starlette:
    """The server for the model `load()` returns; it loads in the background once the app starts.
    `open_gpu_sampler` gives the GPU readings' sampler (NVML's; tests give a fake)."""
    runtime = Runtime(settings, load, on_load_failure)
    gpu_readings = GpuReadings(open_gpu_sampler)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runtime.start_loading()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(runtime.close)
            await anyio.to_thread.run_sync(gpu_readings.close)

    middleware: list[Middleware] = []
    if settings.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.allowed_origins),
                allow_methods=["GET", "POST"],
                # Whatever a preflight asks for (the OpenAI JS SDK sends x-stainless-* headers): the origin
                # list is the gate, and no cookies or credentials are allowed.
                allow_headers=["*"],
            )
        )
    if settings.api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key))
    # Innermost of ours, so that a 500 still passes through CORS (a browser can read it).
    middleware.append(Middleware(UnexpectedErrorMiddleware))
    app = Starlette(
        routes=routes(),
        middleware=middleware,
        exception_handlers={
            ApiError: handle_api_error,
            CmpchatError: handle_user_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.gpu_readings = gpu_readings
    return app
