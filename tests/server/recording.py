"""A test-only backend wrapper that logs every prefill and decode call, and can fail on cue."""

from __future__ import annotations

from typing import Any

import numpy as np

from cmpchat.backends.base import Backend


class Recorder(Backend):
    """Wraps a backend and logs every prefill and decode call, in order."""

    def __init__(self, inner: Backend, fail_decode_at: int | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.config = inner.config
        self.calls: list[tuple[str, Any]] = []
        self.fail_decode_at = fail_decode_at

    @property
    def prefilled_tokens(self) -> int:
        return sum(arg[1] for kind, arg in self.calls if kind == "prefill")

    def new_sequence(self) -> Any:
        return self.inner.new_sequence()

    def copy_sequence(self, sequence: Any) -> Any:
        return self.inner.copy_sequence(sequence)

    def sequence_length(self, sequence: Any) -> int:
        return self.inner.sequence_length(sequence)

    def release(self, sequence: Any) -> None:
        self.inner.release(sequence)

    def prefill(self, sequence, tokens, *, positions=None, all_logits=False) -> np.ndarray:
        self.calls.append(("prefill", (id(sequence), len(tokens))))
        return self.inner.prefill(sequence, tokens, positions=positions, all_logits=all_logits)

    def decode(self, sequences, tokens) -> np.ndarray:
        self.calls.append(("decode", tuple(id(s) for s in sequences)))
        if self.fail_decode_at is not None and sum(kind == "decode" for kind, _ in self.calls) == self.fail_decode_at:
            raise RuntimeError("device lost")
        return self.inner.decode(sequences, tokens)
