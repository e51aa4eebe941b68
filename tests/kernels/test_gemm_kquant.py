"""The 4/5/6-bit matmuls beside the batched GEMV under the CUDA simulator: for more than 16 tokens (prompt chunks)
the GEMV's token tiles of 16 and the tiled GEMM (`gemm.py`), for one token the fused GEMV that normalises and
quantises its input itself (`gemv_fused.py`); every type against the reader's dequantised weight times the
int8 activations, every epilogue, a column range of a wider output, row, token and stage tails."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.device_table import SIMULATOR_TUNING
from cmpchat.kernels.gemm import SIMULATOR_TILING, gemm_kquant_launch
from cmpchat.kernels.gemv_fused import gemv_kquant_fused_launch, shared_bytes
from cmpchat.kernels.gemv_kquant import FORMATS, KQUANT_TYPES, kquant_matmul_launch
from cmpchat.model.quant import quantize_activations
from tests.kernels.kquant_reference import int8_activations, random_matrix
from tests.kernels.test_gemv_fused_sim import EPS, rms_norm
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


def fused_kquant(tensor_type, arrays, cols, x, out, mode="store", norm_weight=None, out_first=0, tiling=None):
    """The one-token fused GEMV of a 4/5/6-bit matrix (the simulated backend's tiling unless given)."""
    rows = arrays.nibbles.shape[0]
    tiling = tiling or SIMULATOR_TUNING.gemv_tiling(rows, cols, mode, 1)
    gemv_kquant_fused_launch(tensor_type, arrays, cols, x, out, mode=mode, norm_weight=norm_weight, eps=EPS,
                             out_first=out_first, sm_count=1, tiling=tiling).run()  # fmt: skip
    return out


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_the_fused_one_token_gemv_normalises_quantises_then_multiplies(tensor_type: T) -> None:
    """RMSNorm and int8 quantisation in the prologue, then every type's blocks: against the reader's weight times
    the input the reference quantises (row tails, and rows past one pass of the 1-SM persistent grid)."""
    rng = np.random.default_rng(int(tensor_type) + 300)
    rows = 37
    cols = 512 if FORMATS[tensor_type].group_values == 256 else 1056  # 1056: a partial 32-block step
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    out = fused_kquant(tensor_type, arrays, cols, x, np.zeros((1, rows), np.float32), norm_weight=norm)
    quants, scales = quantize_activations(rms_norm(x, norm))
    x_values = (quants.reshape(1, -1, 32).astype(np.float64) * scales[..., None]).reshape(1, cols)
    assert_close(out, *product(raw, arrays, tensor_type, cols, x_values))


@pytest.mark.parametrize("tensor_type", [T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_the_fused_gemv_accumulates_into_a_column_range_and_gates(tensor_type: T) -> None:
    rng = np.random.default_rng(7)
    rows, cols, first, width = 10, 256, 3, 20
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    quants, scales = quantize_activations(x)
    x_values = (quants.reshape(1, -1, 32).astype(np.float64) * scales[..., None]).reshape(1, cols)
    expected, magnitude = product(raw, arrays, tensor_type, cols, x_values)
    residual = rng.standard_normal((1, width)).astype(np.float32)
    out = fused_kquant(tensor_type, arrays, cols, x, residual.copy(), mode="accumulate", out_first=first)
    untouched = np.r_[0:first, first + rows : width]
    assert np.array_equal(out[:, untouched], residual[:, untouched])
    assert_close(out[:, first : first + rows], residual[:, first : first + rows] + expected, magnitude + 1)
    gated = fused_kquant(tensor_type, arrays, cols, x, np.zeros((1, rows // 2), np.float32), mode="swiglu")
    half = rows // 2
    gate, up = expected[:, :half], expected[:, half:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    assert np.all(np.abs(gated - reference) <= RTOL * (magnitude[:, :half] * np.abs(up) + magnitude[:, half:]) * 4)


def test_the_fused_kquant_launcher_checks_its_output_and_sizes_shared_memory() -> None:
    rng = np.random.default_rng(8)
    _, arrays = random_matrix(rng, T.Q4_K, 4, 256)
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match="no columns"):
        fused_kquant(T.Q4_K, arrays, 256, x, np.zeros((1, 4), np.float32), out_first=1)
    # 256 columns = 64 words, padded to one iteration of 32-block steps: 512 words at 2 steps (2 KB of quants,
    # 256 B of scales and 256 B of xs * sum(x)).
    assert shared_bytes(256, steps=2, kquant=True) == 2048 + 512
