"""`gdn_prefill_gated_norm`: out = RMSNorm(o) * weight * silu(z), in place (launch 5)."""

from __future__ import annotations

import math

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.kernels.elementwise import silu
from cmpchat.kernels.gated_deltanet_chunked.common import (
    NORM_PARTIALS,
    NORM_SQUARES,
    NORM_TOKENS,
    ONE,
    ROW_STRIDE,
    ZERO,
    sum_squares,
)

_NORM_SIGNATURE = "void(float32[:, ::1], float32[::1], float32[:, ::1], float32)"


@kernel(_NORM_SIGNATURE)
def gdn_prefill_gated_norm(projection, norm_weight, out, rms_eps):
    """Block (value head, 16-token tile), thread = column: out = RMSNorm(o) * norm_weight * silu(z), in place."""
    column = cuda.threadIdx.x
    head = cuda.blockIdx.x
    first = cuda.blockIdx.y * NORM_TOKENS
    v_dim = norm_weight.shape[0]
    num_v_heads = out.shape[1] // v_dim
    tokens = out.shape[0]
    z_column = projection.shape[1] - (v_dim + 2) * num_v_heads + head * v_dim + column
    out_column = head * v_dim + column
    values = cuda.local.array(NORM_TOKENS, float32)
    gates = cuda.local.array(NORM_TOKENS, float32)
    squares = cuda.shared.array(NORM_SQUARES, float32)
    partials = cuda.shared.array(NORM_PARTIALS, float32)
    sums = cuda.shared.array(NORM_TOKENS, float32)
    for s in range(NORM_TOKENS):  # o and z of all 16 tokens in flight before the barriers
        o = ZERO
        z = ZERO
        if first + s < tokens:
            o = out[first + s, out_column]
            z = projection[first + s, z_column]
        values[s] = o
        gates[s] = z
        squares[s * ROW_STRIDE + column] = o * o
    cuda.syncthreads()
    sum_squares(squares, partials, sums, v_dim, column, v_dim)
    weight = norm_weight[column]
    for s in range(NORM_TOKENS):
        t = first + s
        if t < tokens:
            inverse_rms = ONE / float32(math.sqrt(sums[s] / float32(v_dim) + rms_eps))
            out[t, out_column] = values[s] * inverse_rms * weight * silu(gates[s])
