"""The 4/5/6-bit matmul for more than 16 tokens (prompt chunks) under the CUDA simulator: token tiles of 16 in
one launch, the last one partial, against the reader's dequantised weight times the int8 activations."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.kernels.gemv_kquant import kquant_matmul_launch
from tests.kernels.kquant_reference import int8_activations, random_matrix
from tests.kernels.test_gemv_kquant import assert_close, product


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
