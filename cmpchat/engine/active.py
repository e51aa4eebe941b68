"""A request inside the engine: its reply, its sequence, what the sequence still has to read, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cmpchat.backends.base import Chosen
from cmpchat.engine.events import Timings
from cmpchat.engine.reply import Reply
from cmpchat.engine.request import EngineEvent, EventSink, GenerationRequest, RequestHandle


@dataclass(eq=False, slots=True)
class ActiveRequest:
    """Engine-thread state of one request from submission to its last event.

    `tokens` is what the sequence reads, in order: the prompt, then every token the reply accepted (end tokens
    included). `fed` counts those the sequence has read, queued steps included; a decoding request's next
    token is `pending`, chosen on the backend and not yet read by the host.
    """

    handle: RequestHandle
    request: GenerationRequest
    reply: Reply
    sink: EventSink
    submitted_at: float
    tokens: list[int] = field(default_factory=list)
    sequence: Any = None
    fed: int = 0
    pending: Chosen | None = None
    group: int = 0
    """The decode group it steps with (the backend keeps `decode_groups` groups in flight)."""
    admitted_at: float = 0.0
    admissions: int = 0
    """Times it got a sequence: more than once after a preemption."""
    cached_tokens: int = 0
    """Tokens resumed from a saved state instead of read, over all its admissions."""
    prefilled_tokens: int = 0
    """Tokens read by prompt steps, over all its admissions."""
    prompt_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    decode_steps: int = 0
    ended: bool = False
    """Its last event (`Finished` or `Failed`) was made."""
    outbox: list[EngineEvent] = field(default_factory=list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def is_prefilling(self) -> bool:
        return self.sequence is not None and self.pending is None and self.fed < len(self.tokens)

    @property
    def is_decoding(self) -> bool:
        return self.pending is not None

    def prompt_rate(self, now: float) -> float:
        """Prompt tokens read per second since the request first got a sequence."""
        return self.prefilled_tokens / (now - self.admitted_at) if now > self.admitted_at else 0.0

    def timings(self) -> Timings:
        """Where this request's time went, measured from the moment it first got a sequence.

        `prompt_tokens` counts the tokens actually read by prompt steps (not those resumed from saved states),
        so the prompt speed is honest. Decode time is wall time from the first token to the last, the rate
        the client saw, since a batched step serves several requests at once.
        """
        prompt_done = self.prompt_done_at if self.prompt_done_at is not None else self.admitted_at
        first = self.first_token_at if self.first_token_at is not None else prompt_done
        last = self.last_token_at if self.last_token_at is not None else first
        return Timings(
            prompt_tokens=self.prefilled_tokens,
            prompt_seconds=max(prompt_done - self.admitted_at, 0.0),
            generated_tokens=self.reply.generated,
            decode_steps=self.decode_steps,
            decode_seconds=max(last - first, 0.0),
            time_to_first_token=max(first - self.admitted_at, 0.0),
        )
