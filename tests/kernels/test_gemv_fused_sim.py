"""The fused one-token GEMV (RMSNorm + quantisation in its prologue) under the CUDA simulator, against the
reference int8 path: quantise (and normalise) in numpy, then the exact block products.

Shapes reach: a row tail inside a 256-word iteration, rows past one grid-stride pass of the persistent
grid (1 simulated SM), odd row counts, all three epilogues, with and without the norm."""

from __future__ import annotations

import numpy as np
import pytest
from test_gemv_sim import assert_close, expected_product, random_q8

from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.device_table import SIMULATOR_TUNING, SM_70, SM_90
from cmpchat.kernels.gemv import repack_q8_0
from cmpchat.kernels.gemv_fused import (
    GROUP_CHOICES,
    NORM_THREADS,
    SM_THREADS,
    STEP_CHOICES,
    FusedGemvTiling,
    gemv_q8_fused_launch,
    shared_bytes,
)
from cmpchat.model.quant import quantize_activations

EPS = 1e-6


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The reference's RMSNorm in fp32, in its operation order."""
    factor = np.float32(1.0) / np.sqrt(np.mean(x * x, dtype=np.float32) + np.float32(EPS))
    return (x * factor * weight).astype(np.float32)


def run_fused(raw, rows, cols, x, mode="store", out=None, norm_weight=None, sm_count=1, tiling=None):
    weight_quants, weight_scales = repack_q8_0(raw, rows, cols)
    if out is None:
        out = np.zeros((1, rows // 2 if mode == "swiglu" else rows), np.float32)
    tiling = tiling or SIMULATOR_TUNING.gemv_tiling(rows, cols, mode, sm_count)  # as the simulated backend's
    launch = gemv_q8_fused_launch(
        weight_quants,
        weight_scales,
        x,
        out,
        mode=mode,
        norm_weight=norm_weight,
        eps=EPS,
        sm_count=sm_count,
        tiling=tiling,
    )
    launch.run()
    return out


@pytest.mark.parametrize("rows, cols", [(7, 96), (40, 1056)])
def test_quantises_then_multiplies_like_the_reference(rows: int, cols: int) -> None:
    rng = np.random.default_rng(rows)
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    expected, magnitude = expected_product(raw, rows, cols, x)
    assert_close(run_fused(raw, rows, cols, x), expected, magnitude)


@pytest.mark.parametrize("groups", GROUP_CHOICES)
@pytest.mark.parametrize("steps", STEP_CHOICES)
def test_every_compiled_variant_gives_the_same_bits(steps: int, groups: int) -> None:
    rng = np.random.default_rng(6)
    # A row tail inside every variant's iteration; 13 pairs over 2 blocks: blocks of 1-3 groups of 2 warps
    # leave some warps without a pair, and 1 group takes pairs in several rounds.
    rows, cols = 26, 1312
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    default = run_fused(raw, rows, cols, x, norm_weight=weight)
    tiling = FusedGemvTiling(steps=steps, blocks_per_sm=2, groups=groups)
    variant = run_fused(raw, rows, cols, x, norm_weight=weight, tiling=tiling)
    np.testing.assert_array_equal(variant, default)


def test_normalises_before_quantising() -> None:
    rng = np.random.default_rng(3)
    rows, cols = 20, 320
    raw = random_q8(rng, rows, cols)
    x = (3.0 * rng.standard_normal((1, cols))).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    normalized = rms_norm(x, weight)
    expected, magnitude = expected_product(raw, rows, cols, normalized)
    # The sum of squares is added in another order than numpy's: a quant may flip by one where x / scale
    # sits on a .5 boundary, which moves a row by at most one quant step times its weight block.
    xq, xs = quantize_activations(normalized)
    assert np.abs(xq).max() <= 127 and xs.min() > 0
    actual = run_fused(raw, rows, cols, x, norm_weight=weight)
    assert np.abs(actual - expected).max() <= 1e-5 * magnitude.max() + 2 * xs.max() * 0.05
    # A wrong normalisation would miss by far more: the product of x itself is ~3x larger.
    unnormalized, _ = expected_product(raw, rows, cols, x)
    assert np.abs(actual - unnormalized).max() > 10 * np.abs(actual - expected).max()


def test_epilogues_accumulate_and_swiglu() -> None:
    rng = np.random.default_rng(4)
    rows, cols = 18, 160
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    expected, magnitude = expected_product(raw, rows, cols, x)

    residual = rng.standard_normal((1, rows)).astype(np.float32)
    accumulated = run_fused(raw, rows, cols, x, mode="accumulate", out=residual.copy())
    assert_close(accumulated, residual + expected, magnitude)

    half = rows // 2
    swiglu = run_fused(raw, rows, cols, x, mode="swiglu")
    gate, up = expected[:, :half], expected[:, half:]
    np.testing.assert_allclose(swiglu, silu(gate) * up, rtol=1e-4, atol=1e-4 * magnitude.max())


def test_wide_inputs_take_one_large_block_per_sm_when_a_narrow_grid_would_loop() -> None:
    row = SM_90
    narrow, wide = row.gemv_narrow, row.gemv_wide
    assert (narrow.groups, narrow.blocks_per_sm, wide.groups, wide.blocks_per_sm) == (2, 1, 3, 1)  # 16, 24 warps
    warps = 132 * narrow.block_threads // 32  # the narrow grid's warps on 132 SMs (2112 on a GPU)
    assert row.gemv_tiling(2 * warps + 2, 4096, "store", 132) == narrow  # not wider than gemv_wide_columns
    assert row.gemv_tiling(2 * warps + 2, 4096 + 32, "store", 132) == wide
    assert row.gemv_tiling(2 * warps, 12288, "accumulate", 132) == narrow  # a warp for each pair
    assert row.gemv_tiling(2 * warps + 1, 12288, "store", 132) == wide  # one pair more (a lone row)
    assert row.gemv_tiling(4 * warps, 12288, "swiglu", 132) == wide  # SwiGLU pairs gate with up rows
    assert row.gemv_tiling(2 * warps, 12288, "swiglu", 132) == narrow
    assert SM_70.gemv_tiling(2 * warps, 12288, "store", 80) == SM_70.gemv_wide  # fewer SMs, fewer narrow warps


def test_launcher_checks_shapes_and_sizes_shared_memory() -> None:
    rng = np.random.default_rng(5)
    raw = random_q8(rng, 4, 64)
    quants, scales = repack_q8_0(raw, 4, 64)
    with pytest.raises(ValueError, match="x must have shape"):
        gemv_q8_fused_launch(quants, scales, np.zeros((2, 64), np.float32), np.zeros((1, 4), np.float32), sm_count=1,
                             tiling=FusedGemvTiling())  # fmt: skip
    with pytest.raises(ValueError, match="norm weight"):
        gemv_q8_fused_launch(
            quants, scales, np.zeros((1, 64), np.float32), np.zeros((1, 4), np.float32),
            norm_weight=np.zeros(32, np.float32), sm_count=1, tiling=FusedGemvTiling(),
        )  # fmt: skip
    # 64 columns = 16 words, padded to one iteration: 256 words at 2 steps (1 KB of quants + 128 B of
    # scales), 512 at 4.
    assert shared_bytes(64, steps=2) == 1024 + 128
    assert shared_bytes(64, steps=4) == 2048 + 256
    with pytest.raises(ValueError, match="steps must be one of"):
        FusedGemvTiling(steps=3)
    with pytest.raises(ValueError, match="groups one of"):
        FusedGemvTiling(groups=4)
    with pytest.raises(ValueError, match="would not all fit"):
        FusedGemvTiling(blocks_per_sm=SM_THREADS // NORM_THREADS + 1, groups=1)
