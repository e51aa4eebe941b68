"""A float64 reference for the Q8_0 matmul GPU tests (GEMV and GEMM): random weights and activations,
their exact product and the sum of |terms| the tolerance scales with."""

from __future__ import annotations

import functools

import numpy as np

from cmpchat.model.quant import quantize_activations


def device(array: np.ndarray):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(array))


@functools.lru_cache(maxsize=2)
def q8_problem(rows: int, cols: int, tokens: int, row_chunk: int = 4096) -> tuple[np.ndarray, ...]:
    """Random Q8_0 weight [rows, cols] and `tokens` quantised activation rows, with their float64 product
    and sum of |terms|, both [tokens, rows] (cached: a parametrisation runs every token count of a shape
    in a row, and 248320-row LM heads take a while in numpy)."""
    rng = np.random.default_rng(rows + cols)
    quants = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    scales = (rng.standard_normal((rows, cols // 32)) * 0.01).astype(np.float16)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    x_quants, x_scales = quantize_activations(x)
    dequantized_x = (x_quants.reshape(tokens, -1, 32) * x_scales[..., None].astype(np.float64)).reshape(tokens, cols)
    expected = np.empty((tokens, rows))
    magnitude = np.empty((tokens, rows))
    for start in range(0, rows, row_chunk):
        block = slice(start, start + row_chunk)
        weight = (quants[block].reshape(-1, cols // 32, 32) * scales[block, :, None].astype(np.float64)).reshape(
            -1, cols
        )
        expected[:, block] = dequantized_x @ weight.T
        magnitude[:, block] = np.abs(dequantized_x) @ np.abs(weight).T
    return quants, scales, x_quants, x_scales, expected, magnitude
