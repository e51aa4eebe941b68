"""A test-only backend wrapper that logs every prefill and decode call, and can fail on cue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend, Logits, Selection, Selector, TokenInput


class Recorder(Backend[Any]):
    """Wraps a backend and logs every prefill and decode call, in order: ("prefill", (id(sequence), tokens))
    and ("decode", (id(sequence), ...))."""

    def __init__(self, inner: Backend[Any], fail_decode_at: int | None = None) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.config = inner.config
        self.pool = inner.pool
        self.max_batch = inner.max_batch
        self.max_sequences = inner.max_sequences
        self.context_limit = inner.context_limit
        self.calls: list[tuple[str, Any]] = []
        self.groups: list[int] = []
        """The decode group of each decode call."""
        self.fail_decode_at = fail_decode_at

    @property
    def prefilled_tokens(self) -> int:
        return sum(arg[1] for kind, arg in self.calls if kind == "prefill")

    @property
    def held_sequences(self) -> int:
        return self.inner.held_sequences

    def new_sequence(self) -> Any:
        return self.inner.new_sequence()

    def fork(self, sequence: Any) -> Any:
        return self.inner.fork(sequence)

    def release(self, sequence: Any) -> None:
        self.inner.release(sequence)

    def length(self, sequence: Any) -> int:
        return self.inner.length(sequence)

    def pages_to_grow(self, sequence: Any, tokens: int) -> int:
        return self.inner.pages_to_grow(sequence, tokens)

    def prefill(self, sequence: Any, tokens: Sequence[int], *, positions: np.ndarray | None = None) -> Logits:
        self.calls.append(("prefill", (id(sequence), len(tokens))))
        return self.inner.prefill(sequence, tokens, positions=positions)

    def decode(self, sequences: Sequence[Any], tokens: Sequence[TokenInput], *, group: int = 0) -> Logits:
        self.calls.append(("decode", tuple(id(s) for s in sequences)))
        self.groups.append(group)
        if self.fail_decode_at is not None and sum(kind == "decode" for kind, _ in self.calls) == self.fail_decode_at:
            raise RuntimeError("device lost")
        return self.inner.decode(sequences, tokens)

    def select(self, logits: Logits, selectors: Sequence[Selector]) -> Selection:
        return self.inner.select(logits, selectors)

    def to_host(self, logits: Logits) -> np.ndarray:
        return self.inner.to_host(logits)

    def score(self, sequence: Any, tokens: Sequence[int]) -> np.ndarray:
        return self.inner.score(sequence, tokens)
