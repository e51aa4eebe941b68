"""Carrying a reply from the generation thread to the screen without slowing the engine.

The worker thread only appends events to a `ReplyBuffer` (a lock and a few list appends per token);
the UI drains it on its own clock (`Settings.refresh_hz`) and gets everything since the last drain
merged into one `ReplyUpdate`. So the screen is redrawn a fixed number of times a second however fast
tokens come, and the engine never waits for a redraw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cmpchat.chat.messages import ToolCall
from cmpchat.engine.events import (
    ContentDelta,
    DecodeProgress,
    Finished,
    GenerationEvent,
    PromptProgress,
    ReasoningDelta,
    ToolCallEvent,
)
from cmpchat.errors import CmpchatError


@dataclass(slots=True)
class ReplyUpdate:
    """What happened since the last drain; `prompt` and `decode` are the latest progress reports."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt: PromptProgress | None = None
    decode: DecodeProgress | None = None
    first_token_seconds: float | None = None
    """Seconds from the request to the first reply text, once it has come."""
    finished: Finished | None = None
    error: str | None = None
    cut: bool = False
    """The error cut off a reply that had begun (`ReplyCut`): what was written is kept, marked interrupted."""

    @property
    def done(self) -> bool:
        return self.finished is not None or self.error is not None


class ReplyBuffer:
    """Events pushed by one generation thread, drained by the UI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = ReplyUpdate()
        self._dirty = False
        self._started = time.perf_counter()
        self._first_token_seconds: float | None = None

    def push(self, event: GenerationEvent) -> None:
        with self._lock:
            pending = self._pending
            if isinstance(event, ContentDelta | ReasoningDelta | ToolCallEvent) and self._first_token_seconds is None:
                self._first_token_seconds = time.perf_counter() - self._started
                pending.first_token_seconds = self._first_token_seconds
            if isinstance(event, ContentDelta):
                pending.content += event.text
            elif isinstance(event, ReasoningDelta):
                pending.reasoning += event.text
            elif isinstance(event, ToolCallEvent):
                pending.tool_calls.append(event.call)
            elif isinstance(event, DecodeProgress):
                pending.decode = event
            elif isinstance(event, PromptProgress):
                pending.prompt = event
            elif isinstance(event, Finished):
                pending.finished = event
            self._dirty = True

    def fail(self, message: str, *, cut: bool = False) -> None:
        with self._lock:
            self._pending.error = message
            self._pending.cut = cut
            self._dirty = True

    def drain(self) -> ReplyUpdate | None:
        """Everything since the last drain, or None when nothing came."""
        with self._lock:
            if not self._dirty:
                return None
            update, self._pending, self._dirty = self._pending, ReplyUpdate(), False
            return update


class ReplyCut(CmpchatError):
    """A reply stopped partway by something outside the app (a server's stream broke off)."""


def run_generation(
    events: Callable[[], Iterable[GenerationEvent]], buffer: ReplyBuffer, describe_error: Callable[[Exception], str]
) -> None:
    """Feed every event of `events()` into `buffer`; runs on the worker thread.

    Any failure ends the reply with an error line instead of killing the worker silently.
    """
    try:
        for event in events():
            buffer.push(event)
    except ReplyCut as err:
        buffer.fail(describe_error(err), cut=True)
    except Exception as err:  # shown to the person; the app keeps running
        buffer.fail(describe_error(err))
