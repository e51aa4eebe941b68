"""Activation quantisation and fused RMSNorm + quantisation under the CUDA simulator, against
`quantize_activations` and `rms_norm` (the numpy rules the GPU mirrors)."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.reference.layers import rms_norm
from cmpchat.kernels.quantize import quantize_launch, rms_norm_quantize_launch
from cmpchat.model.quant import quantize_activations

THREADS = 64  # small blocks keep the simulator fast; n below spans several blocks / rounds


def as_int8(words: np.ndarray) -> np.ndarray:
    return words.view(np.int8).reshape(words.shape[0], -1)


def buffers(tokens: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((tokens, n // 4), np.uint32), np.zeros((tokens, n // 32), np.float32)


def awkward_rows(rng: np.random.Generator, tokens: int, n: int) -> np.ndarray:
    """Random rows of mixed magnitude plus the cases that break naive rounding."""
    x = (rng.standard_normal((tokens, n)) * rng.choice([1e-3, 1.0, 40.0], (tokens, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[0, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # x / scale = k + 0.5 exactly: ties to even
    x[0, 32] = 127.0
    x[-1, -32:] = np.float32(1e-39) * np.arange(32, dtype=np.float32)  # subnormal inputs
    return x


@pytest.mark.parametrize("tokens,n", [(1, 64), (3, 160), (2, 1056)])
def test_quantize_is_bit_exact(tokens: int, n: int) -> None:
    x = awkward_rows(np.random.default_rng(n), tokens, n)
    quants, scales = buffers(tokens, n)
    quantize_launch(x, quants, scales, threads=THREADS).run()
    expected_quants, expected_scales = quantize_activations(x)
    np.testing.assert_array_equal(as_int8(quants), expected_quants)
    np.testing.assert_array_equal(scales, expected_scales)


def near_ties(amax: float, blocks: int) -> np.ndarray:
    """Blocks led by `amax`, the rest values within a few ulp of (k + 0.5) * amax / 127: where x * (1 / scale)
    and a correctly rounded x / scale can round to different integers."""
    scale = np.float32(np.float32(amax) / np.float32(127.0))
    rows = np.empty((blocks, 32), np.float32)
    ks = np.arange(-127, 127).repeat(7)[: blocks * 31]
    ulps = np.tile(np.arange(-3, 4), len(ks) // 7 + 1)[: len(ks)]
    ties = (ks + 0.5) * np.float64(scale)
    values = ties.astype(np.float32)
    for _ in range(3):  # step each value by its ulp count
        values = np.where(ulps > 0, np.nextafter(values, np.float32(np.inf)), values)
        values = np.where(ulps < 0, np.nextafter(values, np.float32(-np.inf)), values)
        ulps = ulps - np.sign(ulps)
    rows[:, 0] = amax
    rows[:, 1:] = np.clip(values, -amax, amax).reshape(blocks, 31)
    return rows.reshape(1, -1)


@pytest.mark.parametrize("amax", [3.0000002, 0.7131, 127.0, 1e-20, 1e-30])
def test_quantize_is_bit_exact_next_to_ties(amax: float) -> None:
    x = near_ties(amax, 56)
    quants, scales = buffers(1, x.shape[1])
    quantize_launch(x, quants, scales, threads=THREADS).run()
    expected_quants, expected_scales = quantize_activations(x)
    np.testing.assert_array_equal(as_int8(quants), expected_quants)
    np.testing.assert_array_equal(scales, expected_scales)


@pytest.mark.parametrize("tokens,n", [(1, 64), (3, 544)])
def test_rms_norm_quantize_matches_the_reference(tokens: int, n: int) -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((tokens, n)) * 3).astype(np.float32)
    weight = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    quants, scales = buffers(tokens, n)
    normalized = np.zeros_like(x)
    rms_norm_quantize_launch(x, weight, 1e-6, quants, scales, normalized, threads=THREADS).run()

    expected = rms_norm(x, weight, 1e-6)
    # Only the sum of squares is added in another order: a few ulp at most.
    np.testing.assert_allclose(normalized, expected, rtol=4e-7, atol=0)
    expected_quants, expected_scales = quantize_activations(expected)
    assert np.abs(as_int8(quants).astype(int) - expected_quants).max() <= 1
    assert np.mean(as_int8(quants) == expected_quants) > 0.999
    np.testing.assert_allclose(scales, expected_scales, rtol=4e-7)
    # What was quantised is exactly the fp32 output.
    own_quants, own_scales = quantize_activations(normalized)
    np.testing.assert_array_equal(as_int8(quants), own_quants)
    np.testing.assert_array_equal(scales, own_scales)


def test_rms_norm_quantize_without_fp32_output_gives_the_same_quants() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    weight = rng.standard_normal(96).astype(np.float32)
    kept, dropped = buffers(2, 96), buffers(2, 96)
    rms_norm_quantize_launch(x, weight, 1e-6, *kept, np.zeros_like(x), threads=THREADS).run()
    before = x.copy()
    rms_norm_quantize_launch(x, weight, 1e-6, *dropped, threads=THREADS).run()
    np.testing.assert_array_equal(x, before)  # the input is not written
    np.testing.assert_array_equal(kept[0], dropped[0])
    np.testing.assert_array_equal(kept[1], dropped[1])


def test_launchers_reject_bad_arguments() -> None:
    x = np.zeros((2, 64), np.float32)
    quants, scales = buffers(2, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_launch(np.zeros((2, 40), np.float32), quants, scales)
    with pytest.raises(ValueError, match="float32"):
        quantize_launch(x.astype(np.float64), quants, scales)
    with pytest.raises(ValueError, match="shape"):
        quantize_launch(x, np.zeros((2, 8), np.uint32), scales)
    with pytest.raises(ValueError, match="uint32"):
        quantize_launch(x, quants.view(np.int32), scales)
    with pytest.raises(ValueError, match="C-contiguous"):
        quantize_launch(np.zeros((64, 2), np.float32).T, quants, scales)
    with pytest.raises(ValueError, match="threads"):
        quantize_launch(x, quants, scales, threads=48)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quantize_launch(x, np.zeros(32, np.float32), 1e-6, quants, scales)
    with pytest.raises(ValueError, match="normalized"):
        rms_norm_quantize_launch(x, np.zeros(64, np.float32), 1e-6, quants, scales, np.zeros((1, 64), np.float32))
