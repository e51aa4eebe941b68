"""The intrinsics' simulator bodies (CI has no GPU: the simulator runs no inline PTX and no warp shuffles,
so these check the fallbacks; the GPU self-test checks the PTX versions against the same numbers)."""

from __future__ import annotations

import numpy as np
from numba import cuda

from cmpchat.cudart.intrinsics import (
    SIMULATOR,
    dp4a,
    load_global_f32x4,
    load_u32x4,
    warp_max_f32,
    warp_sum_f32,
    warp_sum_i32,
)


def test_runs_under_the_simulator():
    assert SIMULATOR


def packed(values: np.ndarray) -> np.ndarray:
    return values.astype(np.int8).view(np.int32)


def test_dp4a_is_a_signed_byte_dot_product():
    @cuda.jit
    def run(a, b, c, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = dp4a(a[i], b[i], c[i])

    rng = np.random.default_rng(0)
    a8 = rng.integers(-128, 128, (64, 4))
    b8 = rng.integers(-128, 128, (64, 4))
    c = rng.integers(-1000, 1000, 64).astype(np.int32)
    out = np.zeros(64, dtype=np.int32)
    run[2, 32](packed(a8).ravel(), packed(b8).ravel(), c, out)
    np.testing.assert_array_equal(out, (a8 * b8).sum(axis=1) + c)


def test_warp_reductions_give_every_lane_the_result():
    @cuda.jit
    def run(x, sums, maxes, ints):
        i = cuda.grid(1)
        sums[i] = warp_sum_f32(x[i])
        maxes[i] = warp_max_f32(x[i])
        ints[i] = warp_sum_i32(i)

    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    sums, maxes, ints = np.zeros(64, np.float32), np.zeros(64, np.float32), np.zeros(64, np.int32)
    run[1, 64](x, sums, maxes, ints)
    for warp in range(2):
        lanes = slice(32 * warp, 32 * warp + 32)
        np.testing.assert_allclose(sums[lanes], x[lanes].sum(), rtol=1e-5)
        np.testing.assert_array_equal(maxes[lanes], x[lanes].max())
        np.testing.assert_array_equal(ints[lanes], np.arange(64)[lanes].sum())


def test_load_u32x4_reads_four_words():
    @cuda.jit
    def run(words, out):
        i = cuda.grid(1)
        a, b, c, d = load_u32x4(words, 4 * i)
        out[i] = a + b + c + d

    words = np.arange(32, dtype=np.uint32)
    out = np.zeros(8, dtype=np.uint32)
    run[1, 8](words, out)
    np.testing.assert_array_equal(out, words.reshape(8, 4).sum(axis=1))


def test_load_global_f32x4_reads_four_values_the_kernel_then_overwrites():
    @cuda.jit
    def run(values):
        i = cuda.grid(1)
        a, b, c, d = load_global_f32x4(values, 4 * i)
        values[4 * i] = a + b + c + d

    values = np.arange(32, dtype=np.float32)
    expected = values.reshape(8, 4).sum(axis=1)
    run[1, 8](values)
    np.testing.assert_array_equal(values[::4], expected)


def test_unpack_f16x2_gives_both_halves_exactly():
    from cmpchat.cudart.intrinsics import unpack_f16x2

    @cuda.jit
    def run(words, low, high):
        i = cuda.grid(1)
        a, b = unpack_f16x2(words[i])
        low[i] = a
        high[i] = b

    halves = np.array([1.5, -2.25, 65504.0, 6e-8, 0.0, -0.0, 0.333, 1024.0], dtype=np.float16)
    words = halves.view(np.uint32)
    low, high = np.zeros(4, np.float32), np.zeros(4, np.float32)
    run[1, 4](words, low, high)
    np.testing.assert_array_equal(low, halves[0::2].astype(np.float32))
    np.testing.assert_array_equal(high, halves[1::2].astype(np.float32))


def test_fma_f32_rounds_once():
    from cmpchat.cudart.intrinsics import fma_f32

    @cuda.jit
    def run(a, b, c, out):
        i = cuda.grid(1)
        out[i] = fma_f32(a[i], b[i], c[i])

    f32 = np.float32
    near_one = f32(1 + 2.0**-12)
    a = np.array([near_one, 2.0**-100, 3.0, -near_one], np.float32)
    b = np.array([near_one, 2.0**-40, 1 / 3, near_one], np.float32)
    c = np.array([-(1 + 2.0**-11), 0.0, -1.0, 1 + 2.0**-11], np.float32)
    out = np.zeros(4, np.float32)
    run[1, 4](a, b, c, out)
    # (1 + 2^-12)^2 - (1 + 2^-11) = 2^-24 exactly, which a rounded product would lose; a subnormal product;
    # 3 * fl(1/3) - 1, exact; the first case negated.
    expected = np.array([2.0**-24, 2.0**-140, float(f32(3.0) * np.float64(f32(1 / 3)) - 1.0), -(2.0**-24)], np.float32)
    np.testing.assert_array_equal(out, expected)
