"""Reference building blocks against direct formulas."""

from __future__ import annotations

import numpy as np

from cmpchat.backends.reference.layers import Linear, apply_rope, rope_angles
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import quantize_activations


def test_int8_linear_is_the_dot_product_of_the_rounded_operands(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    name = "blk.0.ffn_down.weight"
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    quants, scales = quantize_activations(x)
    rounded_x = (quants.reshape(3, -1, 32) * scales[..., None]).reshape(3, 96).astype(np.float64)
    expected = rounded_x @ model_file.dequantize(name).astype(np.float64).T
    got = Linear(model_file, name, mirror_gpu=True)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    exact = Linear(model_file, name, mirror_gpu=False)(x)
    np.testing.assert_allclose(
        exact, x.astype(np.float64) @ model_file.dequantize(name).T.astype(np.float64), rtol=1e-5, atol=1e-5
    )


def test_text_rope_is_plain_neox_rope():
    positions = np.repeat(np.arange(5)[:, None], 3, axis=1)
    angles = rope_angles(positions, rope_dims=8, theta=10000.0, sections=(1, 1, 1, 0))
    x = np.random.default_rng(1).standard_normal((5, 2, 12)).astype(np.float32)
    out = apply_rope(x, angles)
    inv_freq = 10000.0 ** (-np.arange(4) * 2 / 8)
    for t in range(5):
        for i in range(4):
            c, s = np.cos(t * inv_freq[i]), np.sin(t * inv_freq[i])
            np.testing.assert_allclose(out[t, :, i], x[t, :, i] * c - x[t, :, i + 4] * s, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(out[t, :, i + 4], x[t, :, i + 4] * c + x[t, :, i] * s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])  # dims past rope_dims are untouched


def test_multimodal_rope_sections_pick_height_and_width():
    positions = np.array([[7, 100, 1000]])
    angles = rope_angles(positions, rope_dims=64, theta=1.0, sections=(11, 11, 10, 0))
    # With theta 1 every inv_freq is 1, so the angle is the chosen position itself.
    chosen = angles[0]
    for i in range(32):
        if i % 3 == 1 and i < 33:
            assert chosen[i] == 100
        elif i % 3 == 2 and i < 30:
            assert chosen[i] == 1000
        else:
            assert chosen[i] == 7
