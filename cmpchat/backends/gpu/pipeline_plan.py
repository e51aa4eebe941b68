"""How a model's layers are split over a pipeline of stages: contiguous layer ranges, one per stage, chosen so
that the pipeline's shared KV pool is as large as the stages' memories allow, then so that the stages' weights
are as even as that pool leaves room for.

Every stage holds the pages of the one pool (a page number means the same tokens on every stage), so the pool's
size in tokens is one number for the whole pipeline: the smallest over stages of what the stage has left after
its weights, states and scratch, divided by its attention layers' KV bytes per token. The first stage also holds
the embedding and the last the output norm and LM head (on 27B the untied `output.weight` is 1.35 GB).

The search is pure arithmetic over per-layer costs, so it is tested on the CPU with any numbers. For a pool size
and a cap on a stage's weight bytes, taking for each stage in turn the longest run of layers that fits decides
whether any split fits (a stage that starts later only has less to hold), so both are found by bisection: first
the largest pool, then, at that pool, the smallest cap on weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cmpchat.backends.gpu.memory_plan import RESERVE_BYTES
from cmpchat.errors import CmpchatError


@dataclass(frozen=True)
class LayerCosts:
    """Bytes each layer costs a stage, and what only the first and the last stage hold."""

    weights: Sequence[int]
    kv_per_token: Sequence[int]
    """KV bytes per context token (attention layers; 0 for Gated DeltaNet layers)."""
    state_per_sequence: Sequence[int]
    """Recurrent-state bytes per sequence (Gated DeltaNet layers; 0 for attention layers)."""
    first_extra: int
    """The embedding."""
    last_extra: int
    """The output norm and LM head."""

    @property
    def layers(self) -> int:
        return len(self.weights)


@dataclass(frozen=True)
class Split:
    ranges: list[range]
    pool_tokens: int


def split_layers(
    costs: LayerCosts,
    budgets: Sequence[int],
    scratch: Sequence[int],
    *,
    sequences: int,
    page_tokens: int,
    most_tokens: int,
    least_tokens: int,
    counts: Sequence[int] | None = None,
    describe: Callable[[], str] = lambda: "the model",
    labels: Sequence[str] | None = None,
) -> Split:
    """Layer ranges for stages with these `budgets` and `scratch` bytes (one each), holding `sequences` states
    each, and the pool they share, in whole pages: at most `most_tokens`, at least `least_tokens` (else
    CmpchatError with the numbers). `counts`: layers per stage, given (a manual split), instead of searched.
    `labels`: what the refusal calls each stage's device (e.g. "GPU 1")."""
    stages = len(budgets)
    if stages != len(scratch) or stages < 1:
        raise ValueError("one budget and one scratch size per stage")
    if stages > costs.layers:
        raise CmpchatError(f"{stages} stages for {costs.layers} layers: give each stage at least one layer")
    rooms = [b - s - RESERVE_BYTES - (costs.first_extra if i == 0 else 0) - (costs.last_extra if i == stages - 1 else 0)
             for i, (b, s) in enumerate(zip(budgets, scratch, strict=True))]  # fmt: skip
    fixed = [w + sequences * s for w, s in zip(costs.weights, costs.state_per_sequence, strict=True)]
    least_pages = -(-least_tokens // page_tokens)
    most_pages = max(most_tokens // page_tokens, least_pages)

    def cost(layer: int, pages: int) -> int:
        return fixed[layer] + pages * page_tokens * costs.kv_per_token[layer]

    if counts is not None:
        ranges = _ranges_of(counts, costs.layers, stages)
        pages = most_pages
        for room, layers in zip(rooms, ranges, strict=True):
            kv = sum(costs.kv_per_token[i] for i in layers) * page_tokens
            left = room - sum(fixed[i] for i in layers)
            pages = min(pages, left // kv) if kv else pages if left >= 0 else -1
        if pages < least_pages:
            raise CmpchatError(
                _refusal(describe(), costs, budgets, scratch, ranges, least_tokens, sequences, labels, manual=True)
            )
        return Split(ranges, pages * page_tokens)

    def greedy(pages: int, weight_cap: int) -> list[range] | None:
        """Each stage takes the longest run of layers that fits (leaving one for each stage after it)."""
        ranges, start = [], 0
        for stage, room in enumerate(rooms):
            # The LM head's GEMV is part of the last stage's step time; the embedding (one row read) is not.
            left, weight, end = room, costs.last_extra if stage == stages - 1 else 0, start
            last_allowed = costs.layers if stage == stages - 1 else costs.layers - (stages - 1 - stage)
            while end < last_allowed:
                c = cost(end, pages)
                if c > left or weight + costs.weights[end] > weight_cap:
                    break
                left -= c
                weight += costs.weights[end]
                end += 1
            if end == start or (stage == stages - 1 and end < costs.layers):
                return None
            ranges.append(range(start, end))
            start = end
        return ranges

    everything = sum(costs.weights) + costs.last_extra
    if greedy(least_pages, everything) is None:
        tried = greedy(0, everything) or _even(costs.layers, stages)
        raise CmpchatError(
            _refusal(describe(), costs, budgets, scratch, tried, least_tokens, sequences, labels, manual=False)
        )
    low, high = least_pages, most_pages  # low fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if greedy(middle, everything) is not None else (low, middle - 1)
    pages = low
    light, heavy = max(costs.weights), everything  # heavy fits (at a pool that fits)
    while light < heavy:
        middle = (light + heavy) // 2
        light, heavy = (light, middle) if greedy(pages, middle) is not None else (middle + 1, heavy)
    balanced = greedy(pages, heavy)
    assert balanced is not None
    return Split(balanced, pages * page_tokens)


def _ranges_of(counts: Sequence[int], layers: int, stages: int) -> list[range]:
    if len(counts) != stages or any(c < 1 for c in counts) or sum(counts) != layers:
        raise CmpchatError(
            f"--split needs {stages} layer counts of at least 1 that add up to {layers} (one per stage), "
            f"not {','.join(str(c) for c in counts)}"
        )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _even(layers: int, stages: int) -> list[range]:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _refusal(
    name: str, costs: LayerCosts, budgets: Sequence[int], scratch: Sequence[int], ranges: Sequence[range],
    least: int, sequences: int, labels: Sequence[str] | None, *, manual: bool,
) -> str:  # fmt: skip
    """One line: what the model needs over the stages, against what they have, and what to do."""
    gib = 2**30
    weights = sum(costs.weights) + costs.first_extra + costs.last_extra
    states = sequences * sum(costs.state_per_sequence)
    kv = least * sum(costs.kv_per_token)
    have = ", ".join(f"{b / gib:.1f}" + (f" ({labels[i]})" if labels else "") for i, b in enumerate(budgets))
    split = "/".join(f"{r.start}-{r.stop - 1}" for r in ranges)
    advice = "change --split or give the stages more memory" if manual else "add a GPU (--gpus) or use a smaller model"
    return (
        f"{name} does not fit {len(budgets)} stage(s) with a {least}-token KV pool: it needs "
        f"{(weights + states + kv) / gib:.1f} GiB (weights {weights / gib:.1f}, {sequences} sequence states "
        f"{states / gib:.1f}, KV {kv / gib:.1f}) plus {(max(scratch) + RESERVE_BYTES) / gib:.1f} GiB a stage for "
        f"scratch and reserve, and the stages have {have} GiB "
        f"usable (layers {split}); {advice}"
    )
