"""Q8_0 block helpers against the `gguf` package, and the GPU's int8 activation rule."""

from __future__ import annotations

import gguf
import numpy as np

from cmpchat.model.quant import q8_0_dequantize, q8_0_quantize, q8_0_split, quantize_activations


def test_q8_0_quantize_matches_gguf_package():
    values = np.random.default_rng(1).standard_normal((4, 96)).astype(np.float32)
    ours = q8_0_quantize(values)
    theirs = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(
        gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q8_0),
        gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.Q8_0),
    )
    scales, quants = q8_0_split(ours, 4, 96)
    np.testing.assert_array_equal(
        q8_0_dequantize(scales, quants), gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q8_0)
    )


def test_activation_quantisation_rule():
    x = np.array([[0.0] * 32 + list(np.linspace(-2.0, 1.0, 32))], dtype=np.float32)
    quants, scales = quantize_activations(x)
    assert quants.dtype == np.int8 and scales.dtype == np.float32
    assert scales[0, 0] == 0.0 and np.all(quants[0, :32] == 0)  # an all-zero block stays zero
    assert scales[0, 1] == np.float32(2.0) / np.float32(127.0)
    assert quants[0, 32] == -127  # amax maps to +-127
    np.testing.assert_allclose(quants[0, 32:] * scales[0, 1], x[0, 32:], atol=scales[0, 1] / 2 + 1e-7)
