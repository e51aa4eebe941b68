"""`gdn_prefill_conv`: the causal depthwise conv, SiLU and q/k L2 norms of a prompt's tokens (launch 1)."""

from __future__ import annotations

import math

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.kernels.elementwise import silu
from cmpchat.kernels.gated_deltanet import L2_NORM_EPS
from cmpchat.kernels.gated_deltanet_chunked.common import (
    CONV_PARTIALS,
    CONV_SQUARES,
    CONV_TOKENS,
    ONE,
    ROW_STRIDE,
    ZERO,
    sum_squares,
)

_CONV_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, ::1], int32, int32, int32, int32, float32)"
)


@kernel(_CONV_SIGNATURE)
def gdn_prefill_conv(projection, conv_weight, conv_state, mixed, slot, num_k_heads, k_head_dim, v_head_dim, q_scale):
    """Block (head, 16-token tile), thread = channel of the head: heads 0..Hk-1 are q, Hk..2Hk-1 are k, then
    the Hv value heads. Outputs stay in registers until q/k's L2 norms are known (each written once)."""
    lane = cuda.threadIdx.x
    lanes = cuda.blockDim.x
    head = cuda.blockIdx.x
    first = cuda.blockIdx.y * CONV_TOKENS
    tokens = projection.shape[0]
    taps = conv_weight.shape[1]
    history = taps - 1
    qk_heads = 2 * num_k_heads
    if head < qk_heads:
        width = k_head_dim
        channel = head * k_head_dim + lane
    else:
        width = v_head_dim
        channel = qk_heads * k_head_dim + (head - qk_heads) * v_head_dim + lane
    squares = cuda.shared.array(CONV_SQUARES, float32)
    partials = cuda.shared.array(CONV_PARTIALS, float32)
    norms = cuda.shared.array(CONV_TOKENS, float32)
    values = cuda.local.array(CONV_TOKENS, float32)
    active = lane < width
    if active and taps == 4:  # the released width: a sliding window in registers, one load per token
        w0 = conv_weight[channel, 0]
        w1 = conv_weight[channel, 1]
        w2 = conv_weight[channel, 2]
        w3 = conv_weight[channel, 3]
        x0 = ZERO
        x1 = ZERO
        x2 = ZERO
        for m in range(3):  # inputs first-3 .. first-1: before the prompt, the carried raw inputs
            source = first - 3 + m
            x = ZERO
            if source >= 0:
                if source < tokens:
                    x = projection[source, channel]
            else:
                x = conv_state[slot, history + source, channel]
            x0 = x1
            x1 = x2
            x2 = x
        for s in range(CONV_TOKENS):
            t = first + s
            x3 = ZERO
            if t < tokens:
                x3 = projection[t, channel]
            values[s] = silu(x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3)  # the reference's tap order
            x0 = x1
            x1 = x2
            x2 = x3
    elif active:
        for s in range(CONV_TOKENS):
            t = first + s
            total = ZERO
            for tap in range(taps):  # tap 0 is the oldest input, tap K-1 the current one
                source = t - history + tap
                x = ZERO
                if source >= 0:
                    if source < tokens:
                        x = projection[source, channel]
                else:  # before the prompt: the carried raw inputs (only the first tile gets here)
                    x = conv_state[slot, history + source, channel]
                total += x * conv_weight[channel, tap]
            values[s] = silu(total)
    if head < qk_heads:  # uniform over the block: L2 norm of each token's head, then q's scale
        for s in range(CONV_TOKENS):
            value = ZERO
            if active and first + s < tokens:
                value = values[s]
            squares[s * ROW_STRIDE + lane] = value * value
        cuda.syncthreads()
        sum_squares(squares, partials, norms, width, lane, lanes)
        scale = ONE
        if head < num_k_heads:
            scale = q_scale
        if active:
            for s in range(CONV_TOKENS):
                values[s] = values[s] / float32(math.sqrt(norms[s] + L2_NORM_EPS)) * scale
    if active:
        for s in range(CONV_TOKENS):
            t = first + s
            if t < tokens:
                mixed[t, channel] = values[s]
    if cuda.blockIdx.y == 0 and active:
        # The new state is entries T..T+K-2 of [old state | inputs]. This thread alone reads and writes this
        # channel's state (the conv above included), and old entry m+T is read (for entry m) before it is
        # itself overwritten.
        for m in range(history):
            source = tokens - history + m
            if source >= 0:
                conv_state[slot, m, channel] = projection[source, channel]
            else:
                conv_state[slot, m, channel] = conv_state[slot, m + tokens, channel]
