"""The 4/5/6-bit matmul on a GPU (`pytest -m gpu`) at Qwen3.5 9B's shapes: every type on the attention
projection's 4096 x 4096, the FFN's gate|up (SwiGLU) and down in the types a Q4_K_M file gives them, at one
token, a full tile of 16 and several tiles (a prompt chunk), against float64 numpy of the reader's weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.reference.layers import silu
from cmpchat.kernels.gemv_kquant import KQUANT_TYPES, KQuantArrays, kquant_matmul_launch
from tests.kernels.kquant_reference import int8_activations, random_matrix
from tests.kernels.q8_reference import device
from tests.kernels.test_gemv_kquant import assert_close, product

pytestmark = pytest.mark.gpu

TOKENS = [1, 16, 37]


def on_device(arrays: KQuantArrays) -> KQuantArrays:
    return KQuantArrays(**{f.name: device(getattr(arrays, f.name)) for f in dataclasses.fields(arrays)})


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_every_type_at_the_9b_attention_shape(tensor_type: T, tokens: int) -> None:
    rng = np.random.default_rng(int(tensor_type) * 7 + tokens)
    rows = cols = 4096
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    xq, xs, x_values = int8_activations(rng, tokens, cols)
    out = device(np.zeros((tokens, rows), np.float32))
    kquant_matmul_launch(tensor_type, on_device(arrays), cols, device(xq), device(xs), out).run()
    assert_close(out.copy_to_host(), *product(raw, arrays, tensor_type, cols, x_values))


@pytest.mark.parametrize("tokens", TOKENS)
def test_the_9b_ffn_as_q4_k_m_gives_it(tokens: int) -> None:
    """gate|up Q4_K through the SwiGLU epilogue, then down Q6_K accumulated into the residual stream."""
    rng = np.random.default_rng(tokens)
    d, f = 4096, 12288
    raw, arrays = random_matrix(rng, T.Q4_K, 2 * f, d)
    xq, xs, x_values = int8_activations(rng, tokens, d)
    expected, magnitude = product(raw, arrays, T.Q4_K, d, x_values)
    gated = device(np.zeros((tokens, f), np.float32))
    kquant_matmul_launch(T.Q4_K, on_device(arrays), d, device(xq), device(xs), gated, mode="swiglu").run()
    gate, up = expected[:, :f], expected[:, f:]
    reference = silu(gate.astype(np.float32)).astype(np.float64) * up
    bound = 1e-5 * (magnitude[:, :f] * np.abs(up) + magnitude[:, f:]) * 4
    assert np.all(np.abs(gated.copy_to_host() - reference) <= bound + 1e-30)

    raw, arrays = random_matrix(rng, T.Q6_K, d, f)
    xq, xs, x_values = int8_activations(rng, tokens, f)
    residual = rng.standard_normal((tokens, d)).astype(np.float32)
    hidden = device(residual)
    kquant_matmul_launch(T.Q6_K, on_device(arrays), f, device(xq), device(xs), hidden, mode="accumulate").run()
    expected, magnitude = product(raw, arrays, T.Q6_K, f, x_values)
    assert_close(hidden.copy_to_host(), residual + expected, magnitude + 1)
