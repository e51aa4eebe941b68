"""Prompt speed of the CUDA backend: tok/s for prompts of several lengths, against llama.cpp's pp.

For one model file on GPU 0: a prompt of random token ids is fed in calls of `call_tokens` (as the
generator feeds a chat's prompt, `GenerationOptions.prefill_chunk`), timed from the first call to the GPU
finishing the last, after warm-up prompts that compile and capture every step the backend uses. Then the
prompt's last long-prompt step (the backend's `prompt_rows` tokens, at that prompt's context) is profiled by
kernel family, which gives the GEMMs' rate against the dp4a peak and a projection for a CMP 100-210 (the prefill
issue's):

    CMP step time = GEMM time x (this GPU's dp4a/s / 4.3e12) + every other family's time x (read bandwidth / 818 GB/s)

applied to the measured prompt time as the ratio of the two step times: information, not a measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS
from cmpchat.backends.gpu.step import MAX_ROWS
from cmpchat.bench.kernel_families import FamilyTime, family_times
from cmpchat.bench.limits import CMP_READ_BANDWIDTH
from cmpchat.bench.pipeline_schedule import HostLink, prefill_seconds

if TYPE_CHECKING:
    from cmpchat.backends.gpu.model import CudaBackend

PUBLISHED_CMP_9B_PREFILL = {
    "llama.cpp": {297: 199, 1160: 316, 4620: 361, 18440: 324},
    "qengine": {297: 594, 1160: 683, 4620: 584, 18440: 393},
}
"""Published prompt tok/s of the 9B Q8_0 model on one CMP 100-210 (llama.cpp build 8462), by prompt size."""

WARMUP_PROMPTS = (PROMPT_ROWS + 17, 2, 4, 8)
"""Prompt lengths whose steps (a long-prompt step, then 16 + 1, 2, 4, 8 rows) reach every captured step
before timing."""


CMP_DP4A_PER_SECOND = 4.3e12
"""dp4a instructions/s of a CMP 100-210 (its measured 17.2 TOPS read as 4 multiply-adds per dp4a)."""

ProfileStep = Callable[[Any], list[tuple[Sequence[str], Sequence[float]]]]
"""(kernel names, seconds) of one replay of a sequence's long-prompt step, one pair per pipeline stage."""


@dataclass(frozen=True)
class PrefillRates:
    """This GPU's limits, measured in the same run."""

    read_bandwidth: float
    """Bytes/s of a streaming read (as `cmpchat doctor`)."""
    dp4a_per_second: float
    """dp4a instructions/s (8 ops each)."""


@dataclass(frozen=True)
class PrefillRun:
    tokens: int
    seconds: float
    families: list[FamilyTime] = field(default_factory=list)
    """One long-prompt step of PROMPT_ROWS tokens at this prompt's last, by kernel family (empty when the
    prompt is shorter or nothing was profiled), over every stage."""
    gemm_ops: int = 0
    """Ops (2 per multiply-add) of that step's GEMMs."""
    stage_families: list[list[FamilyTime]] = field(default_factory=list)
    """The same step stage by stage, each timed alone (one entry per stage of a pipeline)."""
    hidden_size: int = 0
    prompt_rows: int = PROMPT_ROWS
    """Tokens per long-prompt step of the backend that ran it."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def gemm_rate(self) -> float | None:
        """Ops/s of the profiled step's GEMMs."""
        gemm = next((f for f in self.families if f.family == "GEMM"), None)
        return self.gemm_ops / gemm.seconds if gemm and gemm.seconds > 0 else None

    def gemm_share_of_peak(self, rates: PrefillRates) -> float | None:
        """The profiled step's GEMM ops/s over the dp4a peak (8 ops per dp4a)."""
        rate = self.gemm_rate()
        return None if rate is None else rate / (8 * rates.dp4a_per_second)

    def cmp_projection(self, rates: PrefillRates) -> float | None:
        """Projected prompt tok/s on a CMP 100-210 (module docstring), or None without a profile."""
        measured = sum(f.seconds for f in self.families)
        if measured <= 0:
            return None
        return self.tokens_per_second * measured / _cmp_seconds(self.families, rates)

    def pipeline_projection(self, rates: PrefillRates, link: HostLink | None = None) -> PipelineProjection | None:
        """Projected prompt tok/s on one CMP card per stage, against one card running the same code: the
        one-card projection with its long-prompt steps replaced by their pipelined schedule
        (`pipeline_schedule`); the tail's steps stay sequential (MAX_ROWS tokens a step), with their hops.
        The profiled step is the prompt's last and dearest (its attention reads the whole prompt), so each chunk
        is given the one-card time spread evenly over the prompt's tokens, divided among the stages as their
        profiles divide the last step. None for one stage or without a profile."""
        one_card = self.cmp_projection(rates)
        if len(self.stage_families) < 2 or one_card is None:
            return None
        link = link or HostLink()
        last_step = [_cmp_seconds(families, rates) for families in self.stage_families]
        one_card_seconds = self.tokens / one_card
        chunk_seconds = one_card_seconds * self.prompt_rows / self.tokens
        stages = [chunk_seconds * s / sum(last_step) for s in last_step]
        chunks, tail = divmod(self.tokens, self.prompt_rows)
        timed = prefill_seconds(stages, chunks, self.prompt_rows * self.hidden_size * 4, link)
        hops = 2 * (len(stages) - 1)
        tail_hops = sum(
            hops * link.seconds(min(MAX_ROWS, tail - start) * self.hidden_size * 4)
            for start in range(0, tail, MAX_ROWS)
        )
        seconds = one_card_seconds - chunks * chunk_seconds + timed.seconds + tail_hops
        return PipelineProjection(len(stages), self.tokens / seconds, one_card, timed.busy)


@dataclass(frozen=True)
class PipelineProjection:
    cards: int
    tokens_per_second: float
    one_card_tokens_per_second: float
    busy: list[float]
    """Each card's share of the long-prompt steps' span that it computes."""

    @property
    def speedup(self) -> float:
        return self.tokens_per_second / self.one_card_tokens_per_second


def _cmp_seconds(families: Sequence[FamilyTime], rates: PrefillRates) -> float:
    """A step's time on a CMP 100-210: its GEMMs at the CMP's dp4a rate, the rest at its read bandwidth."""
    gemm_factor = rates.dp4a_per_second / CMP_DP4A_PER_SECOND
    read_factor = rates.read_bandwidth / CMP_READ_BANDWIDTH
    return sum(f.seconds * (gemm_factor if f.family == "GEMM" else read_factor) for f in families)


def run_prefill(
    backend: CudaBackend,
    sizes: Sequence[int],
    call_tokens: int = 512,
    say: Callable[[str], None] = print,
    profile_step: ProfileStep | None = None,
) -> list[PrefillRun]:
    """Time one prompt of each size (random ids, fixed seed) on a fresh sequence; with `profile_step`, profile
    the last long-prompt step of each prompt that had one."""
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
        backend.synchronize()
        started = time.perf_counter()
        for begin in range(0, size, call_tokens):
            backend.prefill(sequence, tokens[begin : begin + call_tokens])
        backend.synchronize()
        seconds = time.perf_counter() - started
        families: list[FamilyTime] = []
        stage_families: list[list[FamilyTime]] = []
        if profile_step is not None and size >= backend.prompt_rows:
            profiles = profile_step(sequence)
            stage_families = [family_times(names, times, {}) for names, times in profiles]
            families = family_times(
                [n for names, _ in profiles for n in names], [t for _, ts in profiles for t in ts], {}
            )
        runs.append(PrefillRun(size, seconds, families, gemm_ops_per_step(backend), stage_families,
                               backend.config.hidden_size, backend.prompt_rows))  # fmt: skip
        backend.release(sequence)
    return runs


def gemm_ops_per_step(backend: CudaBackend) -> int:
    """Ops of a long-prompt step's GEMMs: 2 x its rows per weight of every layer's matrices."""
    from cmpchat.backends.gpu.weights import AttentionWeights

    weights = 0
    for layer in (layer for stage in backend.stages for layer in stage.weights.layers.values()):
        mixer = layer.mixer
        inner = mixer.qkv if isinstance(mixer, AttentionWeights) else mixer.projection
        for matrix in (inner, mixer.output, layer.gate_up, layer.down):
            weights += matrix.rows * matrix.cols
    return 2 * backend.prompt_rows * weights
