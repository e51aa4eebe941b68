"""The 4/5/6-bit matmuls for more than 16 tokens (prompt chunks) under the CUDA simulator: the GEMV's token tiles
of 16 and the tiled GEMM (`gemm.py`), every type against the reader's dequantised weight times the int8
activations, every epilogue, a column range of a wider output, row, token and stage tails."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.gemm import SIMULATOR_TILING, gemm_kquant_launch
from cmpchat.kernels.gemv_kquant import FORMATS, KQUANT_TYPES, kquant_matmul_launch
from tests.kernels.kquant_reference import int8_activations, random_matrix
from tests.kernels.test_gemv_kquant import RTOL, assert_close, product


@pytest.mark.parametrize("tensor_type", [T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_token_tiles_equal_dequantise_then_multiply(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type) + 100)
    rows, cols, tokens = 4, 256, 37  # tiles of 16, 16 and 5 tokens
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = np.zeros((tokens, rows), np.float32)
    launch = kquant_matmul_launch(tensor_type, arrays, cols, xq, xs, out)
    assert launch.grid == (1, 3)  # 2 row pairs: one block of the simulator's 2 warps; 3 token tiles
    launch.run()
    assert_close(out, *product(raw, arrays, tensor_type, cols, x_values))


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_the_gemm_equals_dequantise_then_multiply(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type) + 200)
    # 40 rows: a row tile of 32 and a partial one; 35 tokens: a token tile and 3; the legacy types 7 blocks,
    # stages of 2 with a partial last one (the k-quants hold whole groups of 256: two groups, 16 blocks).
    rows, tokens = 40, 35
    cols = 512 if FORMATS[tensor_type].group_values == 256 else 224
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = np.zeros((tokens, rows), np.float32)
    launch = gemm_kquant_launch(tensor_type, arrays, cols, xq, xs, out, tiling=SIMULATOR_TILING)
    assert launch.grid == (2, 2)
    launch.run()
    assert_close(out, *product(raw, arrays, tensor_type, cols, x_values))


@pytest.mark.parametrize("tensor_type", [T.Q4_K, T.Q6_K, T.Q4_0], ids=lambda t: t.name)
def test_the_gemm_accumulates_into_a_column_range_and_gates(tensor_type: T) -> None:
    rng = np.random.default_rng(3)
    rows, cols, tokens, first, width = 36, 256, 20, 5, 48
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    expected, magnitude = product(raw, arrays, tensor_type, cols, x_values)

    residual = rng.standard_normal((tokens, width)).astype(np.float32)
    out = residual.copy()
    gemm_kquant_launch(
        tensor_type, arrays, cols, xq, xs, out, mode="accumulate", out_first=first, tiling=SIMULATOR_TILING
    ).run()
    untouched = np.r_[0:first, first + rows : width]
    assert np.array_equal(out[:, untouched], residual[:, untouched])
    assert_close(out[:, first : first + rows], residual[:, first : first + rows] + expected, magnitude + 1)

    gated = np.zeros((tokens, rows // 2), np.float32)
    gemm_kquant_launch(tensor_type, arrays, cols, xq, xs, gated, mode="swiglu", tiling=SIMULATOR_TILING).run()
    half = rows // 2
    gate, up = expected[:, :half], expected[:, half:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    bound = RTOL * (magnitude[:, :half] * np.abs(up) + magnitude[:, half:]) * 4
    assert np.all(np.abs(gated - reference) <= bound + 1e-30)


def test_the_gemm_launcher_refuses_wrong_operands() -> None:
    rng = np.random.default_rng(4)
    _, arrays = random_matrix(rng, T.Q4_K, 4, 256)
    xq, xs, _ = int8_activations(rng, 20, 256)
    with pytest.raises(ValueError, match="no columns"):
        gemm_kquant_launch(T.Q4_K, arrays, 256, xq, xs, np.zeros((20, 4), np.float32), out_first=1,
                           tiling=SIMULATOR_TILING)  # fmt: skip
    with pytest.raises(ValueError, match="whole blocks"):
        gemm_kquant_launch(T.Q4_K, arrays, 128, xq, xs, np.zeros((20, 4), np.float32), tiling=SIMULATOR_TILING)
