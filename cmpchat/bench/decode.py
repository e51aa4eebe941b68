"""Decode speed of the CUDA backend: tok/s at several contexts and batch sizes, against the read limit.

For one model file on GPU 0: greedy decode with CUDA-graph replay and selection on the GPU (only the chosen
ids cross PCIe, as in the app), timed over `tokens` steps after a warm-up; at each context a profile of one
step by kernel family. Longer contexts are reached with `CudaBackend.skip_ahead` (zeroed cache entries:
attention reads them exactly as it reads real ones), which is quicker than running a 32K prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cmpchat.bench.kernel_families import FamilyTime, family_times, kernel_family
from cmpchat.bench.limits import StepBytes, cmp_projection, limit_tokens_per_second, step_bytes
from cmpchat.sampling import SamplingParams

if TYPE_CHECKING:
    from cmpchat.backends.gpu.model import CudaBackend, CudaSequence

WARMUP_STEPS = 8


@dataclass(frozen=True)
class DecodeRun:
    context: int
    batch: int
    tokens_per_second: float
    """Aggregate over the batch."""
    bytes: StepBytes
    limit: float
    """Tokens/s at the streaming-read bandwidth."""
    step_seconds: float
    """Wall time of one step including selection and the host round trip."""
    replay_seconds: float | None = None
    """GPU time of one plain graph replay (profiled runs only)."""
    families: list[FamilyTime] = field(default_factory=list)
    kernels: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per kernel name: launches and total seconds in one step (profiled runs only)."""

    @property
    def ratio(self) -> float:
        return self.tokens_per_second / self.limit

    @property
    def cmp_projection(self) -> float:
        return cmp_projection(self.ratio, self.bytes.total, self.batch)


@dataclass(frozen=True)
class BenchPhase:
    """One load of the model: its sequence slots and context per slot, and the runs made on it."""

    sequences: int
    context: int
    contexts: tuple[int, ...]
    """Batch-1 runs, one per context."""
    batches: tuple[int, ...]
    """Batched runs, at `batch_context`."""
    batch_context: int


def plan_phases(
    contexts: Sequence[int], batches: Sequence[int], margin: int, fits: Callable[[int, int], bool]
) -> tuple[list[BenchPhase], list[str]]:
    """The loads a benchmark needs, and a note for each run that does not fit on this GPU.

    `fits(sequences, context)` says whether that many slots of that context fit beside the weights. One load
    serves everything when it all fits (a big GPU); otherwise one load with a single slot for the contexts
    and one with many short slots for the batches (a 16 GB card holds a 9B model and one 32K context, or 16
    short ones, not both).
    """
    batch_context = contexts[0]
    every = max([1, *batches])
    longest = max(contexts) + margin
    if fits(every, longest):
        return [BenchPhase(every, longest, tuple(contexts), tuple(batches), batch_context)], []
    notes = []
    phases = []
    single = [c for c in contexts if fits(1, c + margin)]
    notes += [f"context {c} does not fit on this GPU beside the weights; skipped" for c in contexts if c not in single]
    if single:
        phases.append(BenchPhase(1, max(single) + margin, tuple(single), (), batch_context))
    many = [b for b in batches if fits(b, batch_context + margin)]
    notes += [
        f"{b} sequences of {batch_context} tokens do not fit on this GPU; skipped" for b in batches if b not in many
    ]
    if many:
        phases.append(BenchPhase(max(many), batch_context + margin, (), tuple(many), batch_context))
    return phases, notes


def run_decode(
    backend: CudaBackend,
    weights: int,
    read_bandwidth: float,
    phase: BenchPhase,
    tokens: int,
    say: Callable[[str], None] = print,
) -> list[DecodeRun]:
    """The phase's batch-1 runs, one per context (profiled), then its batched runs."""
    contexts, batches = phase.contexts, phase.batches
    from cmpchat.cudart.profile import cost_in_replay, profile_launches

    config = backend.config
    runs = []
    for context in contexts:
        say(f"  decoding {tokens} tokens at context {context}")
        sequences = _sequences_at(backend, 1, context)
        seconds = _time_steps(backend, sequences, tokens)
        launches = backend.step_launches(1)
        profile = profile_launches(launches, backend.stream)
        in_replay = cost_in_replay(launches, backend.stream, kernel_family)
        bytes_ = step_bytes(weights, config, context)
        family_bytes = {
            "GEMV": weights,
            "attention": bytes_.kv_cache,
            "GDN": bytes_.recurrent_state,
        }
        runs.append(
            DecodeRun(
                context=context,
                batch=1,
                tokens_per_second=tokens / seconds,
                bytes=bytes_,
                limit=limit_tokens_per_second(read_bandwidth, bytes_.total),
                step_seconds=seconds / tokens,
                replay_seconds=profile.replay,
                families=family_times(profile.names, profile.attributed(), family_bytes, in_replay),
                kernels=_by_kernel(profile.names, profile.attributed()),
            )
        )
        _release(backend, sequences)
    for batch in batches:
        context = phase.batch_context
        say(f"  decoding {tokens} steps of {batch} sequences at context {context}")
        sequences = _sequences_at(backend, batch, context)
        seconds = _time_steps(backend, sequences, tokens)
        bytes_ = step_bytes(weights, config, context, batch)
        runs.append(
            DecodeRun(
                context=context,
                batch=batch,
                tokens_per_second=batch * tokens / seconds,
                bytes=bytes_,
                limit=limit_tokens_per_second(read_bandwidth, bytes_.total, batch),
                step_seconds=seconds / tokens,
            )
        )
        _release(backend, sequences)
    return runs


def _sequences_at(backend: CudaBackend, count: int, context: int) -> list[CudaSequence]:
    sequences = [backend.new_sequence() for _ in range(count)]
    for sequence in sequences:
        backend.skip_ahead(sequence, context)
    return sequences


def _release(backend: CudaBackend, sequences: list[CudaSequence]) -> None:
    for sequence in sequences:
        backend.release(sequence)


def _time_steps(backend: CudaBackend, sequences: list[CudaSequence], tokens: int) -> float:
    """Seconds for `tokens` greedy steps of all `sequences` (after a warm-up that compiles and captures)."""
    count = len(sequences)
    greedy = [SamplingParams()] * count
    rngs = [np.random.default_rng(i) for i in range(count)]
    histories: list[list[int]] = [[1] for _ in range(count)]
    logits = backend.decode(sequences, [1] * count)

    def step(logits: object) -> object:
        # As the generator: the next step reads the ids where the GPU chose them, and they come back (B ids)
        # while it runs.
        choice = backend.choose(logits, greedy, histories, rngs)
        logits = backend.decode_chosen(sequences, choice)
        choice.ids()
        return logits

    for _ in range(WARMUP_STEPS):
        logits = step(logits)
    backend.stream.synchronize()
    started = time.perf_counter()
    for _ in range(tokens):
        logits = step(logits)
    backend.stream.synchronize()
    return time.perf_counter() - started


def _by_kernel(names: Sequence[str], seconds: Sequence[float]) -> dict[str, tuple[int, float]]:
    totals: dict[str, tuple[int, float]] = {}
    for name, value in zip(names, seconds, strict=True):
        count, total = totals.get(name, (0, 0.0))
        totals[name] = (count + 1, total + value)
    return totals
