"""The CUDA backend's sampler with allowed-token masks, under the simulator: masked rows choose within their
masks, unmasked rows as before, step after step as the constrained rows and their masks change."""

from __future__ import annotations

import numpy as np
from numba import cuda

from cmpchat.backends.gpu.sampler import GpuSampler
from cmpchat.sampling import SamplingParams, mask_words

VOCAB = 80
ROWS = 4


def packed(allowed_ids: list[int]) -> np.ndarray:
    bits = np.zeros(mask_words(VOCAB) * 32, np.uint8)
    bits[allowed_ids] = 1
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def test_masked_rows_choose_within_their_masks_step_after_step() -> None:
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    sampler = GpuSampler(
        stream, False, cuda.to_device(np.zeros((ROWS, VOCAB), np.float32)), cuda.to_device(np.zeros(ROWS, np.int32))
    )
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.9)]
    rngs = [np.random.default_rng(i) for i in range(ROWS)]
    steps: list[list[list[int] | None]] = [
        [[3, 7, 79], [10, 11], None, [0]],
        [None, None, None, None],  # no row constrained: the unmasked graph
        [None, [5], [40, 41, 42], None],  # other rows masked than before: their masks are the ones uploaded
    ]
    for allowed in steps:
        logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
        masks = [None if ids is None else packed(ids) for ids in allowed]
        chosen = sampler.select(cuda.to_device(logits), params, [[1, 2]] * ROWS, rngs, masks).tokens()
        for row, ids in enumerate(allowed):
            if ids is not None:
                assert chosen[row] in ids
                if params[row].is_greedy:
                    assert chosen[row] == ids[int(np.argmax(logits[row, ids]))]
            elif params[row].is_greedy:
                assert chosen[row] == int(np.argmax(logits[row]))


def test_ids_past_a_short_mask_are_not_chosen() -> None:
    """A grammar's mask covers the tokenizer's ids; an LM head wider than it has padding rows, never chosen."""
    stream = cuda.stream()
    sampler = GpuSampler(
        stream, False, cuda.to_device(np.zeros((1, VOCAB), np.float32)), cuda.to_device(np.zeros(1, np.int32))
    )
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, 70] = 5.0  # the best id lies past the mask's 64
    short = np.full(2, 0xFFFFFFFF, np.uint32)
    choice = sampler.select(cuda.to_device(logits), [SamplingParams()], [[]], [np.random.default_rng(0)], [short])
    assert choice.tokens() == [0]
