"""The interface every backend implements: sequences, prompt and decode steps, and token selection.

A backend turns token ids into next-token logits for many sequences at once and chooses each row's next token.
Steps may only be queued (a GPU backend returns before the device has run them), so they hand out handles:
`prefill` and `decode` return the step's `Logits`, `select` returns a `Selection` whose `tokens()` waits for the
ids. A decode step can take its tokens straight from an earlier `Selection` (`Chosen`), so the engine queues the
step that consumes a token before the host has read it:

    logits = backend.prefill(sequence, prompt)
    selection = backend.select(logits, [selector])
    logits = backend.decode([sequence], [Chosen(selection, 0)])   # queued before the id is on the host
    token = selection.tokens()[0]                                  # read while that step runs

KV caches live in a shared pool of pages (`kv_pool`); `pool` says how full it is, so the engine can admit,
grow and preempt sequences before a step would run out of pages. Sequences are the backend's own type `S`.

Images enter a prompt step as rows of hidden states (`ImageRows`, the vision encoder's output) that replace
the embeddings of their `<|image_pad|>` tokens, with the prompt's (t, h, w) positions (`prefill_with_images`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import numpy as np

from cmpchat.backends.kv_pool import PagePool
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.sampling import SamplingParams, TokenLogprobs, sample_token, token_logprobs

S = TypeVar("S")
"""A backend's sequence state: its KV pages, recurrent state and position."""

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total) for slow preparations."""


@dataclass(frozen=True, slots=True)
class Selector:
    """How to choose one row's next token: its settings, the tokens it has seen (for the penalties), the
    generator its draws come from (so a seeded reply is reproducible), the tokens a grammar allows, and
    whether to report log-probabilities."""

    params: SamplingParams
    history: Sequence[int]
    rng: np.random.Generator
    allowed: np.ndarray | None = None
    """A packed mask (uint32 [ceil(vocab / 32)], bit i % 32 of word i // 32) of the ids that may be chosen;
    None: any."""
    logprobs: int | None = None
    """Report the chosen token's log-probability and those of this many most likely tokens; None: none."""


class Logits:
    """The next-token logits of a step's rows, where the backend keeps them (a GPU backend: on the device)."""

    rows: int


class HostLogits(Logits):
    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        """float32 [rows, vocab]"""
        self.rows = int(values.shape[0])


class Selection(ABC):
    """The tokens chosen for a step's rows, possibly still being chosen on a device."""

    rows: int

    @abstractmethod
    def tokens(self) -> list[int]:
        """The chosen ids, one per row (waits for the device where they are chosen there)."""

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row, the log-probabilities its selector asked for (None where it asked for none); waits as
        `tokens` does."""
        return [None] * self.rows


class HostSelection(Selection):
    def __init__(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None] | None = None) -> None:
        self._ids = [int(i) for i in ids]
        self.rows = len(self._ids)
        self._logprobs: list[TokenLogprobs | None] = [None] * self.rows if logprobs is None else list(logprobs)

    def tokens(self) -> list[int]:
        return self._ids

    def logprobs(self) -> list[TokenLogprobs | None]:
        return self._logprobs


@dataclass(frozen=True, slots=True)
class Chosen:
    """A decode input: the token `selection` chose for its row `row`, wherever it is."""

    selection: Selection
    row: int


TokenInput = int | Chosen


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Hidden-state rows that stand in for the embeddings of a step's tokens `start .. start + len(rows)`."""

    start: int
    """Index of the first replaced token within the step's tokens."""
    rows: np.ndarray
    """float32 [tokens, hidden size]: an image's merged tokens (or a run of them, where a chunk cuts it)."""


def checked_images(images: Sequence[ImageRows], tokens: int, hidden_size: int) -> list[ImageRows]:
    """The images sorted by start; each must lie inside the step's `tokens`, apart from the others, `hidden_size`
    wide (`prefill_with_images`' contract, checked by every backend that reads images)."""
    ordered = sorted(images, key=lambda image: image.start)
    end = 0
    for image in ordered:
        if image.rows.ndim != 2 or image.rows.shape[1] != hidden_size:
            raise ValueError(f"image rows of shape {image.rows.shape}; the model's hidden size is {hidden_size}")
        if image.start < end or image.start + len(image.rows) > tokens:
            raise ValueError(f"image rows at {image.start}..{image.start + len(image.rows)} overlap or leave the "
                             f"step's {tokens} tokens")  # fmt: skip
        end = image.start + len(image.rows)
    return ordered


def host_tokens(inputs: Sequence[TokenInput]) -> list[int]:
    """The ids of decode inputs, waiting for the selections they come from."""
    return [item if isinstance(item, int) else item.selection.tokens()[item.row] for item in inputs]


@dataclass(frozen=True)
class StageSummary:
    """One pipeline stage as front ends see it."""

    index: int
    gpu_index: int
    gpu_uuid: str
    """"GPU-…" where known (NVML numbers cards its own way), else ""."""
    layers: range
    handoffs: int
    """Hand-offs of hidden states from this stage to the next so far (0 for the last)."""
    handoff_bytes: int


class Backend(ABC, Generic[S]):
    """A loaded model that runs prompt and decode steps for sequences of type `S` and selects their tokens."""

    name: ClassVar[str]
    config: ModelConfig
    pool: PagePool
    """The KV-cache pages every sequence draws from."""
    max_batch: int
    """Rows one decode step takes at most."""
    max_sequences: int
    """Sequences (running ones and saved prefixes together) the backend can hold at once."""
    context_limit: int
    """Tokens one sequence may hold at most."""
    decode_groups: int = 1
    """Decode steps of different sequence groups the backend can have in flight at once (pipeline stages)."""
    spread_decode_groups: bool = False
    """Whether the groups' steps run at the same time (stages on separate GPUs), so sequences are spread over
    the groups; else the engine fills one group before it starts the next."""
    reads_images: ClassVar[bool] = False
    """Whether `prefill_with_images` takes image rows (else it refuses them)."""

    # -- sequences --------------------------------------------------------------------------------

    @abstractmethod
    def new_sequence(self) -> S:
        """An empty sequence; raises CmpchatError when `max_sequences` are held."""

    @abstractmethod
    def fork(self, sequence: S) -> S:
        """An independent sequence that has read what `sequence` has: it shares its KV pages (copied only where
        one of them appends to a shared page) and copies its recurrent state."""

    @abstractmethod
    def release(self, sequence: S) -> None:
        """Give back its pages and state; the sequence must not be used again."""

    @abstractmethod
    def length(self, sequence: S) -> int:
        """Tokens the sequence has read."""

    @abstractmethod
    def pages_to_grow(self, sequence: S, tokens: int) -> int:
        """Free KV pages reading `tokens` more tokens would take."""

    @property
    def free_sequences(self) -> int:
        """Sequences that can still be made (`new_sequence` or `fork`) before `max_sequences` are held."""
        return self.max_sequences - self.held_sequences

    @property
    @abstractmethod
    def held_sequences(self) -> int:
        """Sequences made and not yet released."""

    # -- steps ------------------------------------------------------------------------------------

    @abstractmethod
    def prefill(self, sequence: S, tokens: Sequence[int], *, positions: np.ndarray | None = None) -> Logits:
        """Queue reading `tokens` into `sequence`; the logits after the last one (one row).

        `positions` gives (t, h, w) multimodal RoPE positions [T, 3]; by default text positions follow on.
        """

    def prefill_with_images(
        self, sequence: S, tokens: Sequence[int], *, positions: np.ndarray, images: Sequence[ImageRows]
    ) -> Logits:
        """Queue reading `tokens` with their (t, h, w) `positions` [T, 3], each of `images` in place of its
        tokens' embeddings; the logits after the last token (one row). The sequence's next text position is
        then one past the largest position read. A backend without an image path refuses in one line."""
        raise CmpchatError(f"the {self.name} backend does not read images")

    @abstractmethod
    def decode(self, sequences: Sequence[S], tokens: Sequence[TokenInput], *, group: int = 0) -> Logits:
        """Queue one token for each sequence in one step (at most `max_batch`) of decode group `group` (below
        `decode_groups`); its logits, a row each."""

    def select(self, logits: Logits, selectors: Sequence[Selector]) -> Selection:
        """Queue choosing a token for each row of `logits` (host-side here; GPU backends choose on the GPU)."""
        rows = self.to_host(logits)
        if len(selectors) != rows.shape[0]:
            raise ValueError(f"{len(selectors)} selectors for {rows.shape[0]} rows of logits")
        ids = [sample_token(row, s.params, s.history, s.rng, s.allowed) for row, s in zip(rows, selectors)]
        reports = [
            None if s.logprobs is None else token_logprobs(row, token, s.logprobs)
            for row, s, token in zip(rows, selectors, ids)
        ]
        return HostSelection(ids, reports)

    def to_host(self, logits: Logits) -> np.ndarray:
        """Logits as a host array [rows, vocab] (a copy from the GPU on GPU backends: only when asked)."""
        if not isinstance(logits, HostLogits):
            raise TypeError(f"{type(logits).__name__} is not this backend's logits")
        return logits.values

    @abstractmethod
    def score(self, sequence: S, tokens: Sequence[int]) -> np.ndarray:
        """Read `tokens` into `sequence` and return the logits after every one of them [T, vocab], on the host
        (perplexity, KL and tests; slower than `prefill`, which keeps only the last row)."""

    # -- the rest ---------------------------------------------------------------------------------

    def warm_up(self, progress: Progress | None = None, *, max_rows: int = 1) -> None:  # noqa: B027
        """Prepare what requests would otherwise wait for (a GPU backend: compile and capture the prompt steps
        and the decode step of every batch size up to `max_rows` rows). The reference has nothing to prepare."""

    def describe(self) -> list[str]:
        """Lines for the user about where the model runs (a GPU backend: the cards and their memory plans)."""
        return []

    def stage_summaries(self) -> list[StageSummary] | None:
        """Where the layers run, stage by stage, for front ends that show it; None for a backend without
        pipeline stages (the CPU reference)."""
        return None
