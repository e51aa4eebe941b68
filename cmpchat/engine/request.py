"""What a front end hands the batching engine, and what the engine tells it back besides the reply's events."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cmpchat.chat.messages import Tool
from cmpchat.engine.events import GenerationEvent
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.vision.prompt_images import PromptImages


class QueueFull(CmpchatError):
    """Every slot is busy and the waiting queue holds as many requests as it may."""


class EngineStopped(CmpchatError):
    """The engine was stopped and takes no more requests."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One reply to generate: the prompt's token ids and how to generate after them."""

    prompt: tuple[int, ...]
    options: GenerationOptions = field(default_factory=GenerationOptions)
    starts_in_reasoning: bool = False
    """The prompt opened a `<think>` block, so the reply starts as reasoning."""
    tools: tuple[Tool, ...] | None = None
    cache_points: tuple[int, ...] = ()
    """Prompt positions where the sequence state is worth keeping for later requests, besides the prefill
    chunk boundaries: typically where the generation prompt begins, because the next turn of the same
    conversation repeats everything before it."""
    images: PromptImages | None = None
    """The prompt's images: their runs of pad tokens, encoded rows and the prompt's (t, h, w) positions."""

    def __post_init__(self) -> None:
        if any(not 0 < point < len(self.prompt) for point in self.cache_points):
            raise ValueError("cache points must lie strictly inside the prompt")
        if self.images is not None and len(self.images.positions) != len(self.prompt):
            raise ValueError("the images' positions must cover the prompt")

    @property
    def image_marks(self) -> list[tuple[int, bytes]]:
        """Where the prompt's images start and their digests: part of a saved state's key."""
        return [] if self.images is None else self.images.marks()


@dataclass(frozen=True, slots=True)
class Started:
    """The request got a slot; the first `cached_tokens` of its prompt came from a saved state."""

    cached_tokens: int
    queue_seconds: float


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine could not finish the request (e.g. the backend raised); no `Finished` follows."""

    message: str


EngineEvent = GenerationEvent | Started | Failed
"""Events of one request in order: `Started`, the generation's events, then `Finished` (or `Failed`)."""

EventSink = Callable[[Sequence[EngineEvent]], None]
"""Receives a request's events, a batch per engine step, on the engine's thread; it must not block."""


class RequestHandle:
    """The submitter's side of a request: its id, and a thread-safe way to cancel it."""

    def __init__(self, request_id: int, wake: Callable[[], None]) -> None:
        self.id = request_id
        self._cancelled = threading.Event()
        self._wake = wake

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the request at the next step; a waiting request leaves the queue, a running one frees its slot.

        The reply then finishes with reason "cancelled" (unless it finished first).
        """
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()
