"""The served model and its engine, and the bridge from the engine's thread to asyncio.

The model loads on a background thread so the server answers /health (503) while it loads. Each
request gets an asyncio queue; the engine's event callback puts batches on it with
`loop.call_soon_threadsafe`, the only thing it may do from the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from cmpchat.api import Model
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import ContentDelta, DecodeProgress, Finished, ReasoningDelta
from cmpchat.engine.request import (
    EngineEvent,
    EngineStopped,
    Failed,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    Started,
)
from cmpchat.errors import CmpchatError
from cmpchat.server.errors import ApiError
from cmpchat.server.settings import ServerSettings
from cmpchat.server.slots import SlotHolder, SlotTable

log = logging.getLogger("cmpchat.server")

ModelLoader = Callable[[], Model]


class LoadState(Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class Runtime:
    """Holds the model and engine once loaded; `on_failure(message)` hears of a model that failed to load."""

    def __init__(
        self,
        settings: ServerSettings,
        load: ModelLoader,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.state = LoadState.LOADING
        self.error: str | None = None
        self.model: Model | None = None
        self.engine: Engine[Any] | None = None
        self.model_name = settings.model_name or ""
        self.created = int(time.time())
        self.slots = SlotTable(settings.slots)
        self._load = load
        self._on_failure = on_failure
        self._closed = False
        self._lock = threading.Lock()

    def start_loading(self) -> None:
        threading.Thread(target=self._load_model, name="cmpchat-model-loader", daemon=True).start()

    def _load_model(self) -> None:
        try:
            model = self._load()
            settings = self.settings
            engine = model.configure_engine(
                slots=settings.slots,
                max_waiting=settings.max_queue,
                prefill_chunk=settings.prefill_chunk,
                cache_states=settings.prefix_cache_entries,
            )
        except Exception as err:  # any failure must reach the operator as one line, and /health
            message = str(err) if isinstance(err, CmpchatError) else f"{type(err).__name__}: {err}"
            if not isinstance(err, CmpchatError):
                log.exception("loading the model failed")
            self.state, self.error = LoadState.FAILED, message
            if self._on_failure is not None:
                self._on_failure(message)
            return
        with self._lock:
            if self._closed:
                return
            engine.start()
            self.model, self.engine = model, engine
            self.model_name = self.model_name or _default_name(model.path)
            self.state = LoadState.READY

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engine = self.engine
        if engine is not None:
            engine.stop()

    def ready(self) -> tuple[Model, Engine[Any]]:
        """The model and engine, or a 503 saying why they are not there."""
        if self.model is None or self.engine is None:
            if self.state is LoadState.FAILED:
                raise ApiError(503, f"the model failed to load: {self.error}")
            raise ApiError(503, "the model is still loading; try again shortly", code="model_loading")
        return self.model, self.engine

    def open(self, request: GenerationRequest) -> RequestStream:
        """Submit `request`; call from the event loop that will read the stream."""
        _, engine = self.ready()
        return RequestStream(engine, request, self.slots)


class RequestStream:
    """One submitted request seen from asyncio: its event batches in order, and cancellation; it keeps its row
    of `slots` up to date from the events read."""

    def __init__(self, engine: Engine[Any], request: GenerationRequest, slots: SlotTable) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Sequence[EngineEvent]] = asyncio.Queue()

        def deliver(events: Sequence[EngineEvent]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, events)
            except RuntimeError:
                pass  # the event loop has closed: nobody is left to read

        self._queue = queue
        self.finished = False
        try:
            self.handle: RequestHandle = engine.submit(request, deliver)
        except (QueueFull, EngineStopped) as err:
            raise ApiError(503, str(err), code="server_busy" if isinstance(err, QueueFull) else None) from None
        except CmpchatError as err:
            raise ApiError(400, str(err)) from None
        self._slots = slots
        self._holder = SlotHolder(self.handle.id, request.options)

    async def batches(self) -> AsyncIterator[Sequence[EngineEvent]]:
        while not self.finished:
            events = await self._queue.get()
            for event in events:
                self._note(event)
            yield events

    def _note(self, event: EngineEvent) -> None:
        holder = self._holder
        if isinstance(event, Started):
            self._slots.take(holder)
        elif isinstance(event, DecodeProgress):
            holder.generated = event.generated_tokens
            holder.decoding = True
        elif isinstance(event, ContentDelta | ReasoningDelta):
            holder.new_line = holder.new_line or "\n" in event.text
        elif isinstance(event, Finished | Failed):
            self.finished = True
            self._slots.give_back(holder)

    def cancel(self) -> None:
        """Stop generating (the client went away); harmless once finished."""
        if not self.finished:
            self.handle.cancel()
            self._slots.give_back(self._holder)


def _default_name(path: Path) -> str:
    return path.name.removesuffix(".gguf")
