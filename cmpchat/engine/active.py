"""A request inside the engine: its reply, backend sequence, prefill progress, timings and pending events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cmpchat.engine.events import Timings
from cmpchat.engine.reply import Reply
from cmpchat.engine.request import EngineEvent, EventSink, GenerationRequest, RequestHandle


@dataclass(eq=False, slots=True)
class ActiveRequest:
    """Engine-thread state of one request from submission to its last event."""

    handle: RequestHandle
    request: GenerationRequest
    reply: Reply
    sink: EventSink
    submitted_at: float
    sequence: Any = None
    admitted_at: float = 0.0
    prefilled: int = 0
    """Prompt tokens the sequence has consumed, cached ones included."""
    cached_tokens: int = 0
    next_token: int | None = None
    """The sampled token the next decode step feeds in."""
    prompt_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    decode_steps: int = 0
    outbox: list[EngineEvent] = field(default_factory=list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def is_prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    def timings(self) -> Timings:
        """Where this request's time went, measured from the moment it got a slot.

        `prompt_tokens` counts the tokens actually prefilled (not those resumed from the prefix cache), so
        the prompt speed is honest. Decode time is wall time from the first token to the last, the rate
        the client saw, since a batched step serves several requests at once.
        """
        prompt_done = self.prompt_done_at if self.prompt_done_at is not None else self.admitted_at
        first = self.first_token_at if self.first_token_at is not None else prompt_done
        last = self.last_token_at if self.last_token_at is not None else first
        return Timings(
            prompt_tokens=self.prefilled - self.cached_tokens,
            prompt_seconds=max(prompt_done - self.admitted_at, 0.0),
            generated_tokens=self.reply.generated,
            decode_steps=self.decode_steps,
            decode_seconds=max(last - first, 0.0),
            time_to_first_token=max(first - self.admitted_at, 0.0),
        )
