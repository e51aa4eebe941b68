"""The 4/5/6-bit GEMV under the CUDA simulator at tiny shapes: every type against the reader's dequantised
weight times the int8 activations (float64), every epilogue, a column range of a wider output, row tails,
several staged chunks and padded token buckets, and the launcher's checks.

The simulator runs a Python thread per CUDA thread (2 warps per block there), so shapes stay at a few blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.gemv_kquant import KQUANT_TYPES, chunk_blocks, kquant_matmul_launch
from cmpchat.model.dequant import dequantize_rows
from tests.kernels.kquant_reference import decode_repacked, int8_activations, random_matrix

RTOL = 1e-5  # of the sum of |terms|: fp32 summation order is the only difference


def assert_close(actual: np.ndarray, expected: np.ndarray, magnitude: np.ndarray) -> None:
    excess = np.abs(actual - expected) - RTOL * magnitude - 1e-30
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"


def product(raw, arrays, tensor_type, cols, x_values):
    """(y, sum of |terms|) in float64: the reader's exact weight times the int8 activations' values."""
    weight = dequantize_rows(raw, tensor_type, cols).astype(np.float64)
    _, magnitude = decode_repacked(arrays, tensor_type, cols)
    return x_values @ weight.T, np.abs(x_values) @ magnitude.T


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_every_type_equals_dequantise_then_multiply(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type))
    rows, cols, tokens = 5, 512, 3  # an odd row (a pair alone), tokens padded to the bucket of 4
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = np.zeros((tokens, rows), np.float32)
    kquant_matmul_launch(tensor_type, arrays, cols, xq, xs, out).run()
    assert_close(out, *product(raw, arrays, tensor_type, cols, x_values))


def test_several_chunks_and_a_partial_last_step() -> None:
    rng = np.random.default_rng(1)
    tokens = 16
    cols = (chunk_blocks(tokens) + 8) * 32  # a full chunk, then a chunk of 8 blocks: most lanes idle
    raw, arrays = random_matrix(rng, T.Q4_K, 4, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = np.zeros((tokens, 4), np.float32)
    kquant_matmul_launch(T.Q4_K, arrays, cols, xq, xs, out).run()
    assert_close(out, *product(raw, arrays, T.Q4_K, cols, x_values))


@pytest.mark.parametrize("tensor_type", [T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_accumulate_into_a_column_range_and_swiglu(tensor_type: T) -> None:
    rng = np.random.default_rng(2)
    rows, cols, tokens, first = 6, 256, 2, 4
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    expected, magnitude = product(raw, arrays, tensor_type, cols, x_values)

    residual = rng.standard_normal((tokens, 12)).astype(np.float32)
    out = residual.copy()
    kquant_matmul_launch(tensor_type, arrays, cols, xq, xs, out, mode="accumulate", out_first=first).run()
    untouched = np.r_[0:first, first + rows : 12]
    assert np.array_equal(out[:, untouched], residual[:, untouched])
    assert_close(out[:, first : first + rows], residual[:, first : first + rows] + expected, magnitude + 1)

    gated = np.zeros((tokens, rows // 2), np.float32)
    kquant_matmul_launch(tensor_type, arrays, cols, xq, xs, gated, mode="swiglu").run()
    half = rows // 2
    gate, up = expected[:, :half], expected[:, half:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    bound = RTOL * (magnitude[:, :half] * np.abs(up) + magnitude[:, half:]) * 4
    assert np.all(np.abs(gated - reference) <= bound + 1e-30)


def test_the_launcher_refuses_wrong_operands() -> None:
    rng = np.random.default_rng(3)
    _, arrays = random_matrix(rng, T.Q4_K, 2, 256)
    xq, xs, _ = int8_activations(rng, 1, 256)
    out = np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match="no 4/5/6-bit GEMV for Q8_0"):
        kquant_matmul_launch(T.Q8_0, arrays, 256, xq, xs, out)
    with pytest.raises(ValueError, match="weight nibbles must have shape"):
        kquant_matmul_launch(T.Q4_K, arrays, 512, *int8_activations(rng, 1, 512)[:2], out)
    with pytest.raises(ValueError, match="no columns 1..3"):
        kquant_matmul_launch(T.Q4_K, arrays, 256, xq, xs, out, out_first=1)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        kquant_matmul_launch(T.Q6_K, arrays, 128, xq, xs, out)


def test_the_reference_mirrors_the_int8_activations_of_exactly_these_types() -> None:
    from cmpchat.model.quant import INT8_ACTIVATION_TYPES

    assert INT8_ACTIVATION_TYPES == {T.Q8_0, *KQUANT_TYPES}
