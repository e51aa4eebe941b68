"""A test-only backend that "says" chosen text, so engine and protocol tests can check every field exactly.

The prompt decides the script: the text after the last `SAY:` in it, up to the end of that turn or tool
response (or "OK" when there is none), followed by the end token. So a test writes what the model answers into
its own request, e.g. a user message "SAY:<tool_call>...</tool_call>" or a tool result "SAY:It is sunny."

With `queued=True` it behaves as a GPU backend does: steps return at once, and the wait for a step ends when
the tokens chosen after it are read (`step_delay` seconds). `log` records "prefill", "step", "select" and "read"
in the order they happen, so tests can check what was queued before what was read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cmpchat.backends.base import Backend, HostLogits, Logits, Selection, Selector, TokenInput
from cmpchat.backends.kv_pool import PageList, PagePool
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.sampling import sample_token
from cmpchat.tokenizer import Tokenizer

DIRECTIVE = "SAY:"
FOREVER = "FOREVER"
"""A script ending with this word never emits the end token (for cancellation and queue tests)."""
EXPLODE = "EXPLODE"
"""A script ending with this word makes the decode step raise, as a failing device would."""


@dataclass(eq=False)
class ScriptedSequence:
    pages: PageList
    tokens: list[int] = field(default_factory=list)
    prompt: int = 0
    """Tokens read by prompt steps: the script's position counts from there."""
    script: list[int] | None = None
    released: bool = False


class ScriptedSelection(Selection):
    def __init__(self, backend: ScriptedBackend, ids: list[int]) -> None:
        self.backend = backend
        self.rows = len(ids)
        self._ids = ids

    def tokens(self) -> list[int]:
        backend = self.backend
        backend.log.append("read")
        if backend.queued and backend.running:
            time.sleep(backend.step_delay)
            backend.running = False
        return self._ids


class ScriptedBackend(Backend[ScriptedSequence]):
    name = "scripted"

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        *,
        step_delay: float = 0.0,
        queued: bool = False,
        max_batch: int = 16,
        max_sequences: int = 64,
        pool_tokens: int | None = None,
        page_tokens: int = 16,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.step_delay = step_delay
        self.queued = queued
        self.max_batch = max_batch
        self.max_sequences = max_sequences
        self.context_limit = config.context_length
        self.pool = PagePool(-(-(pool_tokens or 4 * config.context_length) // page_tokens), page_tokens)
        self.end_token = tokenizer.encode("<|im_end|>")[0]
        self.prompts: list[str] = []
        self.prefilled_tokens = 0
        self.log: list[str] = []
        self.running = False
        """A queued step has not been waited for yet."""
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_sequences(self) -> int:
        return self._held

    def new_sequence(self) -> ScriptedSequence:
        self._take()
        return ScriptedSequence(PageList(self.pool))

    def fork(self, sequence: ScriptedSequence) -> ScriptedSequence:
        self._take()
        return ScriptedSequence(sequence.pages.share(), list(sequence.tokens), sequence.prompt, sequence.script)

    def release(self, sequence: ScriptedSequence) -> None:
        if not sequence.released:
            sequence.released = True
            sequence.pages.release()
            with self._lock:
                self._held -= 1

    def length(self, sequence: ScriptedSequence) -> int:
        return len(sequence.tokens)

    def pages_to_grow(self, sequence: ScriptedSequence, tokens: int) -> int:
        return sequence.pages.pages_to_grow(tokens)

    def _take(self) -> None:
        with self._lock:
            if self._held >= self.max_sequences:
                raise CmpchatError(f"all {self.max_sequences} sequences are in use")
            self._held += 1

    def prefill(
        self, sequence: ScriptedSequence, tokens: Sequence[int], *, positions: np.ndarray | None = None
    ) -> HostLogits:
        self.log.append("prefill")
        self._read(sequence, tokens)
        sequence.prompt = len(sequence.tokens)
        text = self.tokenizer.decode(sequence.tokens)
        self.prompts.append(text)
        self.prefilled_tokens += len(tokens)
        sequence.script = self._script(text)
        return HostLogits(self._logits(sequence)[None])

    def decode(
        self, sequences: Sequence[ScriptedSequence], tokens: Sequence[TokenInput], *, group: int = 0
    ) -> HostLogits:
        if len(sequences) > self.max_batch:
            raise ValueError(f"{len(sequences)} rows exceed the {self.max_batch} a step takes")
        self.log.append("step")
        self.running = self.queued
        if not self.queued and self.step_delay:
            time.sleep(self.step_delay)
        if any(sequence.script is None for sequence in sequences):
            raise RuntimeError("the device fell off the bus")
        ids = [item if isinstance(item, int) else item.selection._ids[item.row] for item in tokens]  # type: ignore[attr-defined]
        for sequence, token in zip(sequences, ids, strict=True):
            self._read(sequence, [token])
        return HostLogits(np.stack([self._logits(sequence) for sequence in sequences]))

    def select(self, logits: Logits, selectors: Sequence[Selector]) -> ScriptedSelection:
        self.log.append("select")
        rows = self.to_host(logits)
        return ScriptedSelection(
            self,
            [sample_token(row, s.params, s.history, s.rng, s.allowed) for row, s in zip(rows, selectors, strict=True)],
        )

    def score(self, sequence: ScriptedSequence, tokens: Sequence[int]) -> np.ndarray:
        rows = []
        for token in tokens:
            self._read(sequence, [token])
            rows.append(self._logits(sequence))
        return np.stack(rows)

    def _read(self, sequence: ScriptedSequence, tokens: Sequence[int]) -> None:
        if sequence.released:
            raise ValueError("the sequence was released")
        if len(sequence.tokens) + len(tokens) > self.context_limit:
            raise CmpchatError(f"the {self.context_limit}-token context is full")
        sequence.pages.grow(len(tokens))
        sequence.tokens += list(tokens)

    def _script(self, prompt: str) -> list[int] | None:
        start = prompt.rfind(DIRECTIVE)
        if start < 0:
            return self.tokenizer.encode("OK") + [self.end_token]
        text = prompt[start + len(DIRECTIVE) :].split("<|im_end|>")[0].split("\n</tool_response>")[0]
        if text.endswith(EXPLODE):
            return None
        if text.endswith(FOREVER):
            return self.tokenizer.encode(text[: -len(FOREVER)] or "x", parse_special=True)
        return self.tokenizer.encode(text, parse_special=True) + [self.end_token]

    def _logits(self, sequence: ScriptedSequence) -> np.ndarray:
        script = sequence.script or self.tokenizer.encode("x")
        step = len(sequence.tokens) - sequence.prompt
        logits = np.zeros(self.config.vocab_size, dtype=np.float32)
        # A never-ending script repeats its last token.
        logits[script[min(step, len(script) - 1)]] = 10.0
        return logits
