"""The doctor's compute probes under the simulator: each chain kernel stores the value its docstring promises
(so the chains are real work, not dead code), against numpy references the GPU tests reuse; and the HFMA2
intrinsic's fallback is a fused, per-lane fp16 multiply-add."""

from __future__ import annotations

import numpy as np
from numba import cuda

from cmpchat.cudart.intrinsics import fma_f16x2
from cmpchat.kernels.throughput_probes import CHAINS, dp4a_chains, ffma_chains, hfma2_chains

GRID = (2, 32)
THREADS = GRID[0] * GRID[1]


def fp16_pair(low: float, high: float) -> int:
    """Two fp16 values packed in one uint32, low half first."""
    return int(np.array([low, high], np.float16).view(np.uint32)[0])


def dp4a_chains_reference(inputs: np.ndarray, iterations: int) -> int:
    a, b = (np.array([word], np.int32).view(np.int8).astype(np.int64) for word in inputs[:2])
    dot = int((a * b).sum())
    total = sum(int(inputs[2]) + k + iterations * dot for k in range(CHAINS))
    return int(np.array([total], np.int64).astype(np.int32)[0])  # int32 wrap-around, as the kernel adds


def hfma2_chains_reference(inputs: np.ndarray, iterations: int) -> float:
    a, b, acc = (np.array([word], np.uint32).view(np.float16).astype(np.float64) for word in inputs)
    for _ in range(iterations):
        acc = (acc * a + b).astype(np.float16).astype(np.float64)  # float64 is exact here: one rounding
    return float(CHAINS * acc.sum())


def ffma_chains_reference(inputs: np.ndarray, iterations: int) -> float:
    a, b, start = (float(value) for value in inputs)
    total = 0.0
    for k in range(CHAINS):
        acc = np.float32(start + k)
        for _ in range(iterations):
            acc = np.float32(float(acc) * a + b)
        total += float(acc)
    return total


# Inputs whose results are exact in every format involved and differ per chain, lane and step.
DP4A_INPUTS = np.array(
    [np.array([1, -2, 3, -4], np.int8).view(np.int32)[0], np.array([5, 6, -7, 8], np.int8).view(np.int32)[0], 100],
    np.int32,
)
HFMA2_INPUTS = np.array([fp16_pair(1.0, 2.0), fp16_pair(0.5, 0.25), fp16_pair(0.0, 1.0)], np.uint32)
FFMA_INPUTS = np.array([2.0, -1.0, 0.5], np.float32)


def run_chains(dispatcher, inputs: np.ndarray, iterations: int, out_dtype) -> np.ndarray:
    out = np.zeros(THREADS, out_dtype)
    dispatcher[GRID](inputs, np.int32(iterations), out)
    return out


def test_dp4a_chains_store_the_sum_of_their_accumulators():
    out = run_chains(dp4a_chains, DP4A_INPUTS, 3, np.int32)
    assert dp4a_chains_reference(DP4A_INPUTS, 3) == 8 * 100 + 28 + 8 * 3 * (5 - 12 - 21 - 32)
    np.testing.assert_array_equal(out, dp4a_chains_reference(DP4A_INPUTS, 3))


def test_hfma2_chains_store_the_sum_of_both_lanes():
    out = run_chains(hfma2_chains, HFMA2_INPUTS, 3, np.float32)
    # low lane 0 → 0.5 → 1 → 1.5; high lane 1 → 2.25 → 4.75 → 9.75 (acc × 2 + 0.25)
    assert hfma2_chains_reference(HFMA2_INPUTS, 3) == 8 * (1.5 + 9.75)
    np.testing.assert_array_equal(out, hfma2_chains_reference(HFMA2_INPUTS, 3))


def test_ffma_chains_store_the_sum_of_their_accumulators():
    out = run_chains(ffma_chains, FFMA_INPUTS, 4, np.float32)
    # acc × 2 − 1 from 0.5 + k: after 4 steps 16 (0.5 + k) − 15
    assert ffma_chains_reference(FFMA_INPUTS, 4) == sum(16 * (0.5 + k) - 15 for k in range(8))
    np.testing.assert_array_equal(out, ffma_chains_reference(FFMA_INPUTS, 4))


def test_zero_iterations_store_the_starting_values():
    np.testing.assert_array_equal(run_chains(ffma_chains, FFMA_INPUTS, 0, np.float32), 8 * 0.5 + 28)


FUSED_CASE = (fp16_pair(1 + 2**-10, 3.0), fp16_pair(1 + 2**-10, 0.5), fp16_pair(-(1 + 2**-9), -1.0))
"""(1 + 2⁻¹⁰)² − (1 + 2⁻⁹) = 2⁻²⁰ only when fused (rounding the product first gives 0); 3 × 0.5 − 1 = 0.5."""


def test_fma_f16x2_is_fused_per_lane():
    @cuda.jit
    def run(a, b, c, out):
        out[0] = fma_f16x2(a[0], b[0], c[0])

    out = np.zeros(1, np.uint32)
    run[1, 1](*(np.array([word], np.uint32) for word in FUSED_CASE), out)
    assert out[0] == fp16_pair(2**-20, 0.5)
