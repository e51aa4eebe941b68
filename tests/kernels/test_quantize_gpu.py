"""Activation quantisation and RMSNorm + quantisation on a GPU (`pytest -m gpu`) at Qwen3.5 widths."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.reference.layers import rms_norm
from cmpchat.kernels.quantize import quantize_launch, rms_norm_quantize_launch
from cmpchat.model.quant import quantize_activations
from tests.kernels.test_quantize_sim import as_int8, awkward_rows

pytestmark = pytest.mark.gpu


def run_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from numba import cuda

    tokens, n = x.shape
    quants = cuda.device_array((tokens, n // 4), np.uint32)
    scales = cuda.device_array((tokens, n // 32), np.float32)
    quantize_launch(cuda.to_device(x), quants, scales).run()
    return quants.copy_to_host(), scales.copy_to_host()


@pytest.mark.parametrize("n", [4096, 5120, 12288, 17408])
@pytest.mark.parametrize("tokens", [1, 16])
def test_quantize_is_bit_exact(n: int, tokens: int) -> None:
    x = awkward_rows(np.random.default_rng(n + tokens), tokens, n)
    quants, scales = run_quantize(x)
    expected_quants, expected_scales = quantize_activations(x)
    np.testing.assert_array_equal(as_int8(quants), expected_quants)
    np.testing.assert_array_equal(scales, expected_scales)


@pytest.mark.parametrize("n", [4096, 5120])
@pytest.mark.parametrize("tokens", [1, 16])
def test_rms_norm_quantize(n: int, tokens: int) -> None:
    from numba import cuda

    rng = np.random.default_rng(n * tokens)
    x = (rng.standard_normal((tokens, n)) * 5).astype(np.float32)
    weight = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    quants = cuda.device_array((tokens, n // 4), np.uint32)
    scales = cuda.device_array((tokens, n // 32), np.float32)
    normalized = cuda.device_array((tokens, n), np.float32)
    rms_norm_quantize_launch(cuda.to_device(x), cuda.to_device(weight), 1e-6, quants, scales, normalized).run()
    quants, scales, normalized = quants.copy_to_host(), scales.copy_to_host(), normalized.copy_to_host()

    expected = rms_norm(x, weight, 1e-6)
    np.testing.assert_allclose(normalized, expected, rtol=1e-6, atol=0)  # summation order of the mean square
    expected_quants, _ = quantize_activations(expected)
    assert np.abs(as_int8(quants).astype(int) - expected_quants).max() <= 1
    assert np.mean(as_int8(quants) == expected_quants) > 0.999
    own_quants, own_scales = quantize_activations(normalized)
    np.testing.assert_array_equal(as_int8(quants), own_quants)
    np.testing.assert_array_equal(scales, own_scales)
