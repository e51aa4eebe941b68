"""When two greedy runs of the same request may part: where the model's own read paths disagree by rounding.

A request that was preempted and resumed re-reads its tokens through prompt steps, other kernels than the decode
steps that first read them, so its logits differ from its run alone by rounding. How much depends on the model
and its weights: about 1% of the largest |logit| on the demo model, up to 7% on a random-weight 9B file
(cuda/rounding_probe.py). So the rule measures it at the step where the runs part: the step's logits read
three ways (long prompt steps, 16-row chunks, one decode step after the rest); the parting is rounding when the
two runs' choices lie within twice the largest difference between those paths in some path's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def read_paths(backend: Any, tokens: Sequence[int]) -> list[np.ndarray]:
    """The logits after `tokens`, read by `backend` three ways: `prefill` (long prompt steps where it has them),
    `score` (chunks, every row) and a one-row `decode` step after prefilling the rest."""
    rows = []
    sequence = backend.new_sequence()
    try:
        rows.append(np.asarray(backend.to_host(backend.prefill(sequence, tokens)), np.float32).reshape(-1))
    finally:
        backend.release(sequence)
    sequence = backend.new_sequence()
    try:
        rows.append(np.asarray(backend.score(sequence, tokens)[-1], np.float32))
    finally:
        backend.release(sequence)
    if len(tokens) > 1:
        sequence = backend.new_sequence()
        try:
            backend.prefill(sequence, tokens[:-1])
            rows.append(np.asarray(backend.to_host(backend.decode([sequence], [tokens[-1]])), np.float32)[0])
        finally:
            backend.release(sequence)
    return rows


def within_rounding(paths: Sequence[np.ndarray], one: int, other: int) -> bool:
    """Whether tokens `one` and `other` are within twice the paths' largest pairwise difference (absolute) in
    some path's logits of that step: a choice between them may flip by rounding alone."""
    spread = (
        max(float(np.abs(a - b).max()) for i, a in enumerate(paths) for b in paths[i + 1 :]) if len(paths) > 1 else 0.0
    )
    return any(abs(float(logits[one]) - float(logits[other])) <= 2 * spread for logits in paths)


def parting_is_explained(
    backend: Any, prompt: Sequence[int], ours: Sequence[int], theirs: Sequence[int], first_difference: int
) -> bool:
    """Whether two greedy replies to `prompt` (`ours`, `theirs`: reply tokens) that agree before reply token
    `first_difference` may part there by rounding (`within_rounding` of the step's read paths)."""
    tokens = [*prompt, *ours[:first_difference]]
    return within_rounding(read_paths(backend, tokens), ours[first_difference], theirs[first_difference])
