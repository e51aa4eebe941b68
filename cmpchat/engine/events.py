"""What a generation streams to its front end, in order: prompt progress, then text and tool-call
deltas (and, when asked for, each token's log-probabilities) interleaved with decode progress, then exactly
one `Finished`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cmpchat.chat.output_parser import ContentDelta, ReasoningDelta, ToolCallEvent
from cmpchat.sampling import TokenLogprobs

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """Prompt tokens processed so far; sent after each prefill chunk."""

    done: int
    total: int
    tokens_per_second: float


@dataclass(frozen=True, slots=True)
class DecodeProgress:
    """Sent after each generated token: how many so far and the decode speed up to now."""

    generated_tokens: int
    tokens_per_second: float


@dataclass(frozen=True, slots=True)
class Timings:
    """Where the time of one generation went."""

    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int
    decode_steps: int
    decode_seconds: float
    time_to_first_token: float

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation ended: why, the full texts, and its timings."""

    reason: FinishReason
    content: str
    reasoning: str
    tool_calls: tuple[ToolCallEvent, ...]
    timings: Timings
    token_ids: tuple[int, ...] = ()
    """Every token generated, an end token included (what the texts were decoded from)."""
    stop_sequence: str | None = None
    """The stop string that ended the reply (reason "stop"); None when anything else did."""


GenerationEvent = (
    PromptProgress | DecodeProgress | TokenLogprobs | ReasoningDelta | ContentDelta | ToolCallEvent | Finished
)
"""`TokenLogprobs` come only when the request asked for them, one per generated token but the end token,
before the text that token completes."""

__all__ = [
    "ContentDelta",
    "DecodeProgress",
    "FinishReason",
    "Finished",
    "GenerationEvent",
    "PromptProgress",
    "ReasoningDelta",
    "Timings",
    "TokenLogprobs",
    "ToolCallEvent",
]
