"""`gdn_prefill_sequential`: the token-by-token recurrence over a prompt (the reference path the chunks must equal)."""

from __future__ import annotations

import math

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.kernels.elementwise import sigmoid, softplus
from cmpchat.kernels.gated_deltanet import ROWS_PER_THREAD
from cmpchat.kernels.gated_deltanet_chunked.common import (
    COLUMN_TILE,
    MAX_GROUPS,
    MAX_KEY_DIM,
    PARTIALS,
    RECURRENCE_THREADS,
    STAGED_KEYS,
    STAGED_TOKENS,
    STAGED_VALUES,
    ZERO,
)

_SEQUENTIAL_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, :, :, ::1], "
    "float32[:, ::1], int32, int32)"
)


@kernel(_SEQUENTIAL_SIGNATURE, launch_bounds=RECURRENCE_THREADS)
def gdn_prefill_sequential(projection, mixed, ssm_a, dt_bias, delta_state, out, slot, num_k_heads):
    """Block (value head, 32-column slice of S), threads (column j, row group g): the T tokens one by one,
    the state slice in registers throughout; raw o into `out` (the gated norm is launch 4)."""
    column = cuda.threadIdx.x
    group = cuda.threadIdx.y
    groups = cuda.blockDim.y
    head = cuda.blockIdx.x
    value = cuda.blockIdx.y * COLUMN_TILE + column
    thread = column + COLUMN_TILE * group
    threads = COLUMN_TILE * groups
    num_v_heads = delta_state.shape[1]
    k_dim = delta_state.shape[2]
    v_dim = delta_state.shape[3]
    tokens = out.shape[0]
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    key_head = head % num_k_heads
    q_column = key_head * k_dim
    k_column = (num_k_heads + key_head) * k_dim
    v_column = 2 * num_k_heads * k_dim + head * v_dim + value
    b_column = conv_dim + num_v_heads * v_dim + head
    a_column = b_column + num_v_heads
    first_row = group * ROWS_PER_THREAD

    q_shared = cuda.shared.array(STAGED_KEYS, float32)
    k_shared = cuda.shared.array(STAGED_KEYS, float32)
    v_shared = cuda.shared.array(STAGED_VALUES, float32)
    beta_shared = cuda.shared.array(STAGED_TOKENS, float32)
    alpha_shared = cuda.shared.array(STAGED_TOKENS, float32)
    partials = cuda.shared.array(PARTIALS, float32)  # double-buffered by token parity

    head_state = delta_state[slot, head]
    state = cuda.local.array(ROWS_PER_THREAD, float32)
    for m in range(ROWS_PER_THREAD):
        state[m] = head_state[first_row + m, value]

    for base in range(0, tokens, STAGED_TOKENS):
        count = min(STAGED_TOKENS, tokens - base)
        cuda.syncthreads()  # the previous tokens are done with the staged vectors
        for e in range(thread, count * k_dim, threads):
            s = e // k_dim
            r = e % k_dim
            q_shared[s * MAX_KEY_DIM + r] = mixed[base + s, q_column + r]
            k_shared[s * MAX_KEY_DIM + r] = mixed[base + s, k_column + r]
        for s in range(group, count, groups):
            v_shared[s * COLUMN_TILE + column] = mixed[base + s, v_column]
        if thread < count:
            t = base + thread
            beta_shared[thread] = sigmoid(projection[t, b_column])
            log_decay = ssm_a[head] * softplus(projection[t, a_column] + dt_bias[head])  # g <= 0
            alpha_shared[thread] = float32(math.exp(log_decay))  # alpha = exp(g), as the decode kernel
        cuda.syncthreads()

        for s in range(count):
            alpha = alpha_shared[s]
            read_k = ZERO
            read_q = ZERO
            key_query = ZERO
            for m in range(ROWS_PER_THREAD):
                k_r = k_shared[s * MAX_KEY_DIM + first_row + m]
                q_r = q_shared[s * MAX_KEY_DIM + first_row + m]
                state[m] *= alpha
                read_k += state[m] * k_r
                read_q += state[m] * q_r
                key_query += k_r * q_r
            buffer = ((base + s) % 2) * 3 * MAX_GROUPS * COLUMN_TILE
            partials[buffer + group * COLUMN_TILE + column] = read_k
            partials[buffer + (MAX_GROUPS + group) * COLUMN_TILE + column] = read_q
            partials[buffer + (2 * MAX_GROUPS + group) * COLUMN_TILE + column] = key_query
            cuda.syncthreads()
            u = ZERO
            o = ZERO
            kq = ZERO
            for g in range(groups):
                u += partials[buffer + g * COLUMN_TILE + column]
                o += partials[buffer + (MAX_GROUPS + g) * COLUMN_TILE + column]
                kq += partials[buffer + (2 * MAX_GROUPS + g) * COLUMN_TILE + column]
            delta = beta_shared[s] * (v_shared[s * COLUMN_TILE + column] - u)
            if group == 0:
                out[base + s, head * v_dim + value] = o + kq * delta  # (S' + k delta^T)^T q
            for m in range(ROWS_PER_THREAD):
                state[m] += k_shared[s * MAX_KEY_DIM + first_row + m] * delta

    for m in range(ROWS_PER_THREAD):
        head_state[first_row + m, value] = state[m]
