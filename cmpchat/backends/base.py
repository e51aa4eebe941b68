"""The one small interface every backend implements (DESIGN.md: load, prefill, batched decode, release).

A sequence is an opaque per-backend state object: its KV caches, GDN conv and recurrent states and the
next position. The generator drives any backend through these methods only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cmpchat.model.config import ModelConfig
from cmpchat.sampling import SamplingParams, sample_token


class Choice:
    """The tokens chosen for a step's rows (`Backend.choose`). Here they are known at once; a GPU backend's
    subclass holds them on the device, where the next decode step can read them before the host has."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def ids(self) -> list[int]:
        """The chosen token ids, one per row (on a GPU backend this waits for the selection to run)."""
        return self._ids


class Backend(ABC):
    """A loaded model that turns token ids into next-token logits for one or many sequences."""

    name: str
    config: ModelConfig
    decode_is_queued: bool = False
    """True when `decode` and `decode_chosen` return once the step is queued (a GPU backend): a caller can
    queue the step that consumes a choice before reading the chosen ids, and handle those ids (text, events)
    while that step runs."""

    @abstractmethod
    def new_sequence(self) -> Any:
        """An empty sequence state (no tokens seen)."""

    @abstractmethod
    def sequence_length(self, sequence: Any) -> int:
        """Tokens the sequence has consumed so far."""

    @abstractmethod
    def copy_sequence(self, sequence: Any) -> Any:
        """An independent copy of a sequence's state, e.g. to keep a conversation's prefix for reuse."""

    @abstractmethod
    def prefill(
        self,
        sequence: Any,
        tokens: Sequence[int],
        *,
        positions: np.ndarray | None = None,
        all_logits: bool = False,
    ) -> np.ndarray:
        """Feed `tokens` into `sequence`; logits of the last token [vocab], or of every token [T, vocab].

        `positions` gives (t, h, w) multimodal RoPE positions [T, 3]; by default text positions follow on.
        """

    @abstractmethod
    def decode(self, sequences: Sequence[Any], tokens: Sequence[int]) -> Any:
        """One token for each sequence in one step; logits [B, vocab] (a device handle on GPU backends:
        pass it to `sample`, or to `to_host` when the values themselves are needed)."""

    def decode_chosen(self, sequences: Sequence[Any], choice: Choice) -> Any:
        """`decode` of the tokens of `choice` (from `choose` on this backend's latest logits, one row per
        sequence); a GPU backend feeds them from the device without waiting for them."""
        return self.decode(sequences, choice.ids())

    def to_host(self, logits: Any) -> np.ndarray:
        """Logits as a host array (a copy from the GPU on GPU backends: 1 MB per row, so only when asked)."""
        return np.asarray(logits)

    def describe(self) -> list[str]:
        """Lines for the user about where the model runs (a GPU backend: the card and its memory plan)."""
        return []

    def warm_up(self, progress: Callable[[str, int, int], None] | None = None) -> None:  # noqa: B027 (optional hook)
        """Prepare what a first request would otherwise wait for (a GPU backend: compile and capture its
        steps). The reference backend has nothing to prepare."""

    def release(self, sequence: Any) -> None:  # noqa: B027 (optional hook)
        """Give back what the sequence holds. The reference backend holds nothing outside the object."""

    def sample(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
    ) -> list[int]:
        """Pick the next token for each row of `logits` (host-side by default; GPU backends sample on the GPU)."""
        rows = np.atleast_2d(self.to_host(logits))
        return [sample_token(row, p, h, r) for row, p, h, r in zip(rows, params, histories, rngs, strict=True)]

    def choose(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
    ) -> Choice:
        """`sample`, as a `Choice` that `decode_chosen` can take before its ids are read (GPU backends queue
        the selection and return at once)."""
        return Choice(self.sample(logits, params, histories, rngs))
