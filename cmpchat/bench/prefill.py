"""Prompt speed of the CUDA backend: tok/s for prompts of several lengths, against llama.cpp's pp.

For one model file on GPU 0: a prompt of random token ids is fed in calls of `call_tokens` (as the
generator feeds a chat's prompt, `GenerationOptions.prefill_chunk`), timed from the first call to the GPU
finishing the last, after warm-up prompts that compile and capture every step the backend uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cmpchat.backends.cuda.prompt_step import PROMPT_ROWS

if TYPE_CHECKING:
    from cmpchat.backends.cuda.model import CudaBackend

PUBLISHED_CMP_9B_PREFILL = {
    "llama.cpp": {297: 199, 1160: 316, 4620: 361, 18440: 324},
    "qengine": {297: 594, 1160: 683, 4620: 584, 18440: 393},
}
"""Published prompt tok/s of the 9B Q8_0 model on one CMP 100-210 (llama.cpp build 8462), by prompt size."""

WARMUP_PROMPTS = (PROMPT_ROWS + 17, 2, 4, 8)
"""Prompt lengths whose steps (a long-prompt step, then 16 + 1, 2, 4, 8 rows) reach every captured step
before timing."""


@dataclass(frozen=True)
class PrefillRun:
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def run_prefill(
    backend: CudaBackend, sizes: Sequence[int], call_tokens: int = 512, say: Callable[[str], None] = print
) -> list[PrefillRun]:
    """Time one prompt of each size (random ids, fixed seed) on a fresh sequence."""
    rng = np.random.default_rng(0)
    vocab = backend.config.vocab_size
    for length in WARMUP_PROMPTS:
        sequence = backend.new_sequence()
        backend.prefill(sequence, rng.integers(0, vocab, length).tolist())
        backend.release(sequence)
    runs = []
    for size in sizes:
        say(f"  prompt of {size} tokens")
        tokens = rng.integers(0, vocab, size).tolist()
        sequence = backend.new_sequence()
        backend.stream.synchronize()
        started = time.perf_counter()
        for begin in range(0, size, call_tokens):
            backend.prefill(sequence, tokens[begin : begin + call_tokens])
        backend.stream.synchronize()
        runs.append(PrefillRun(size, time.perf_counter() - started))
        backend.release(sequence)
    return runs
