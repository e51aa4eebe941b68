"""When two greedy runs of the same request may part: at a near tie of the top two logits.

A request that was preempted and resumed re-reads its tokens through prompt steps, other kernels than the
decode steps that first read them, so its logits differ from its run alone by rounding. Greedy choices can
then flip only where the two best logits are closer than twice that difference.
"""

from __future__ import annotations

import numpy as np

RESUME_TOLERANCE = 1e-2
"""How far a resumed request's logits may stray, as a share of their largest magnitude (batched against single
decode measure about this much on the GPU: tests/engine/test_batched_decode.py)."""


def near_ties(logits: np.ndarray, tolerance: float = RESUME_TOLERANCE) -> np.ndarray:
    """Per step (a row of `logits`), whether the top two are within 2 x `tolerance` of the row's largest |logit|."""
    top2 = np.sort(logits, axis=1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) <= 2 * tolerance * np.abs(logits).max(axis=1)


def parting_is_explained(logits: np.ndarray, first_difference: int, tolerance: float = RESUME_TOLERANCE) -> bool:
    """Whether two greedy runs that part at generated token `first_difference` met a near tie at or before it;
    `logits` are one run's, a row per generated token (row i chose token i)."""
    return bool(near_ties(logits[: first_difference + 1], tolerance).any())
