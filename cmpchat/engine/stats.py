"""Running totals of what the batching engine did, for monitoring (the server's /metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import get_args

from cmpchat.engine.events import FinishReason

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass(slots=True)
class EngineStats:
    """Totals since start; written by the engine thread, read (approximately, without a lock) by others."""

    prompt_tokens: int = 0
    """Prompt tokens prefilled (tokens resumed from the prefix cache are not counted)."""
    prompt_seconds: float = 0.0
    """Time spent in prefill calls."""
    cached_prompt_tokens: int = 0
    """Prompt tokens resumed from saved states instead of prefilled."""
    decode_steps: int = 0
    """Batched decode steps run."""
    decode_tokens: int = 0
    """Sequence-steps decoded: each step adds its batch size."""
    decode_seconds: float = 0.0
    """Time spent in decode steps, from the call until its tokens are sampled (a GPU step runs meanwhile)."""
    generated_tokens: int = 0
    """Tokens sampled and handed to replies (every reply's first token comes from prefill logits)."""
    finished: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(FINISH_REASONS, 0)))
    """Requests finished, by finish reason. Every key exists from the start, so a reader iterating it on
    another thread never sees it change size."""
    failed: int = 0
    preemptions: int = 0
    """Times a running request gave back its sequence to free KV pages (it resumes later)."""

    def count_finish(self, reason: str, made_tool_calls: bool) -> None:
        self.finished["tool_calls" if reason == "stop" and made_tool_calls else reason] += 1

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of decode time, all sequences of a batched step together."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0
