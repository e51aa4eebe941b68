"""The CUDA backend's sampler reporting log-probabilities, under the simulator: the rows that ask get the
log-softmax of their raw logits (`cmpchat.sampling.token_logprobs`) within 1e-5, step after step, beside rows
that ask for nothing and rows with a grammar's mask."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.sampler import GpuSampler
from cmpchat.sampling import SamplingParams, mask_words, token_logprobs

VOCAB = 72
ROWS = 3


def sampler() -> GpuSampler:
    return GpuSampler(
        cuda.stream(),
        False,
        cuda.to_device(np.zeros((ROWS, VOCAB), np.float32)),
        cuda.to_device(np.zeros(ROWS, np.int32)),
    )


def test_rows_that_ask_get_the_raw_log_softmax_step_after_step() -> None:
    rng = np.random.default_rng(0)
    gpu = sampler()
    params = [SamplingParams(presence_penalty=1.5), SamplingParams(temperature=1.0), SamplingParams()]
    rngs = [np.random.default_rng(i) for i in range(ROWS)]
    only_even = np.full(mask_words(VOCAB), 0x55555555, np.uint32)
    steps: list[tuple[list[int | None], list[np.ndarray | None]]] = [
        ([4, None, 0], [None, None, None]),
        ([None, None, None], [None, None, None]),  # nobody asks: no report, the plain graph
        ([2, 20, None], [None, only_even, None]),
    ]
    for asks, masks in steps:
        logits = (rng.standard_normal((ROWS, VOCAB)) * 2).astype(np.float32)
        choice = gpu.select(cuda.to_device(logits), params, [[3, 5]] * ROWS, rngs, masks, asks)
        tokens, reports = choice.tokens(), choice.logprobs()
        for row, top in enumerate(asks):
            report = reports[row]
            if top is None:
                assert report is None
                continue
            assert report is not None and report.token == tokens[row]
            expected = token_logprobs(logits[row], tokens[row], top)
            assert abs(report.logprob - expected.logprob) < 1e-5
            assert [t for t, _ in report.top] == [t for t, _ in expected.top]
            np.testing.assert_allclose([v for _, v in report.top], [v for _, v in expected.top], atol=1e-5)
        if masks[1] is not None:
            assert tokens[1] % 2 == 0


def test_more_than_twenty_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 20"):
        sampler().select(
            cuda.to_device(np.zeros((1, VOCAB), np.float32)), [SamplingParams()], [[]], [np.random.default_rng()],
            logprobs=[21],
        )  # fmt: skip
