"""`gdn_chunk_prepare`: per chunk, gates, decays, the WY factors W and U and the masked decayed Q K^T (launch 2)."""

from __future__ import annotations

import math

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import load_f32x4, load_shared_f32x4, store_f32x4, store_shared_f32x4
from cmpchat.kernels.elementwise import sigmoid, softplus
from cmpchat.kernels.gated_deltanet_chunked.common import (
    ALIGN,
    GRAM_COLUMNS,
    GRAM_STAGE,
    GRAM_STRIDE,
    MAX_CHUNK,
    ONE,
    TILE_ENTRIES,
    TILE_ENTRIES_2D,
    WIDE_SIZE,
    WIDE_STRIDE,
    ZERO,
    log2,
)

_PREPARE_SIGNATURE = (
    "void(float32[:, ::1], float32[::1], float32[::1], float32[::1], float32[::1], "
    "float32[:, :, :, ::1], float32[:, :, ::1], float32[::1], int32, int32)"
)


@kernel(_PREPARE_SIGNATURE, launch_bounds=(MAX_CHUNK // TILE_ENTRIES) ** 2)
def gdn_chunk_prepare(projection, mixed, ssm_a, dt_bias, w, qk, decay, out, num_k_heads, chunk):
    """Block (chunk, value head), (C/4)^2 threads: the chunk's WY factors, masked Q K^T and decays.

    `mixed` [T*conv_dim], `w` [Hv*T*dk] and `out` [T*Hv*dv] are flat (16-byte accesses); U goes to `out`.
    """
    thread = cuda.threadIdx.x
    threads = cuda.blockDim.x
    chunk_index = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tokens = projection.shape[0]
    num_v_heads = ssm_a.shape[0]
    k_dim = w.shape[0] // (num_v_heads * tokens)
    v_dim = out.shape[0] // (tokens * num_v_heads)
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    out_width = num_v_heads * v_dim
    key_head = head % num_k_heads  # GGUF order: value head h reads key head h % Hk
    q_column = key_head * k_dim
    k_column = (num_k_heads + key_head) * k_dim
    v_column = 2 * num_k_heads * k_dim + head * v_dim
    b_column = conv_dim + num_v_heads * v_dim + head
    a_column = b_column + num_v_heads
    t0 = chunk_index * chunk
    length = min(chunk, tokens - t0)
    side = chunk // TILE_ENTRIES
    ti = thread // side
    tj = thread % side

    log_hi = cuda.shared.array(MAX_CHUNK, float32)
    log_lo = cuda.shared.array(MAX_CHUNK, float32)
    beta_shared = cuda.shared.array(MAX_CHUNK, float32)
    key_scale = cuda.shared.array(MAX_CHUNK, float32)
    stage = cuda.shared.array(GRAM_STAGE, float32, alignment=ALIGN)  # K | Q, then A, then [K' | V'] tiles
    tmat = cuda.shared.array(WIDE_SIZE, float32, alignment=ALIGN)  # T = (I + A)^-1, row-major, stride C+4

    # 1. Gates, and gamma_i = g_1 + ... + g_i as compensated sums (hi + lo): see the reference's docstring.
    i = thread
    while i < length:
        t = t0 + i
        beta_shared[i] = sigmoid(projection[t, b_column])
        log_hi[i] = ssm_a[head] * softplus(projection[t, a_column] + dt_bias[head])  # g <= 0
        i += threads
    cuda.syncthreads()
    if thread == 0:
        total = ZERO
        error = ZERO
        for i in range(length):
            addend = log_hi[i]
            new_total = total + addend
            addend_part = new_total - total
            error += (total - (new_total - addend_part)) + (addend - addend_part)
            total = new_total
            log_hi[i] = total
            log_lo[i] = error
    cuda.syncthreads()
    last_hi = log_hi[length - 1]
    last_lo = log_lo[length - 1]
    i = thread
    while i < length:
        decay_in = float32(math.exp(log_hi[i] + log_lo[i]))  # every exponent here is <= 0
        decay[head, t0 + i, 0] = decay_in
        decay[head, t0 + i, 1] = float32(math.exp((last_hi - log_hi[i]) + (last_lo - log_lo[i])))
        key_scale[i] = beta_shared[i] * decay_in
        i += threads

    # 2. Gram matrices K K^T and Q K^T, thread tile rows ti + side*a, columns tj + side*b, over 32 key dims
    #    staged at a time: per 4 dims 12 LDS.128 (K and Q rows, nearly broadcast; K columns) for 128 FMAs.
    kk = cuda.local.array(TILE_ENTRIES_2D, float32)
    qk_acc = cuda.local.array(TILE_ENTRIES_2D, float32)
    row_k = cuda.local.array(TILE_ENTRIES_2D, float32)
    row_q = cuda.local.array(TILE_ENTRIES_2D, float32)
    col_k = cuda.local.array(TILE_ENTRIES_2D, float32)
    for e in range(TILE_ENTRIES_2D):
        kk[e] = ZERO
        qk_acc[e] = ZERO
    quads = GRAM_COLUMNS // 4
    q_base = MAX_CHUNK * GRAM_STRIDE
    for base in range(0, k_dim, GRAM_COLUMNS):
        cuda.syncthreads()  # the previous tile is consumed
        e = thread
        while e < chunk * quads:
            i = e // quads
            col = 4 * (e % quads)
            k0 = k1 = k2 = k3 = q0 = q1 = q2 = q3 = ZERO
            if i < length:
                row = (t0 + i) * conv_dim + base + col
                k0, k1, k2, k3 = load_f32x4(mixed, row + k_column)
                q0, q1, q2, q3 = load_f32x4(mixed, row + q_column)
            store_shared_f32x4(stage, i * GRAM_STRIDE + col, k0, k1, k2, k3)
            store_shared_f32x4(stage, q_base + i * GRAM_STRIDE + col, q0, q1, q2, q3)
            e += threads
        cuda.syncthreads()
        for col in range(0, GRAM_COLUMNS, 4):
            for a in range(TILE_ENTRIES):
                r = (ti + side * a) * GRAM_STRIDE + col
                row_k[4 * a], row_k[4 * a + 1], row_k[4 * a + 2], row_k[4 * a + 3] = load_shared_f32x4(stage, r)
                row_q[4 * a], row_q[4 * a + 1], row_q[4 * a + 2], row_q[4 * a + 3] = load_shared_f32x4(
                    stage, q_base + r
                )
                c = (tj + side * a) * GRAM_STRIDE + col
                col_k[4 * a], col_k[4 * a + 1], col_k[4 * a + 2], col_k[4 * a + 3] = load_shared_f32x4(stage, c)
            for a in range(TILE_ENTRIES):
                for b in range(TILE_ENTRIES):
                    for d in range(4):
                        kk[a * TILE_ENTRIES + b] += row_k[4 * a + d] * col_k[4 * b + d]
                        qk_acc[a * TILE_ENTRIES + b] += row_q[4 * a + d] * col_k[4 * b + d]
    cuda.syncthreads()  # the Gram stage is consumed: A takes its place

    # 3. A_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (j < i, else 0) into stage [C][C+4]; the masked, decayed
    #    Q K^T out to the workspace (zero above the diagonal and past the chunk's end).
    for a in range(TILE_ENTRIES):
        i = ti + side * a
        for b in range(TILE_ENTRIES):
            j = tj + side * b
            factor = ZERO
            if j <= i and i < length:
                factor = float32(math.exp((log_hi[i] - log_hi[j]) + (log_lo[i] - log_lo[j])))
            qk[head, chunk_index, i, j] = factor * qk_acc[a * TILE_ENTRIES + b]
            a_ij = ZERO
            if j < i:
                a_ij = beta_shared[i] * factor * kk[a * TILE_ENTRIES + b]
            stage[i * WIDE_STRIDE + j] = a_ij

    # 4. T = (I + A)^-1 by blocked forward substitution: thread (ti, tj) holds T's 4x4 block at rows 4ti..4ti+3,
    #    columns 4tj..4tj+3 in registers. In step k the threads of block row k, every earlier block row already
    #    subtracted, finish their diagonal block and publish their rows to tmat; after the step's one barrier
    #    each later block row subtracts A[its rows, 4k..4k+3] T[4k..4k+3, its columns] (4 + 4 LDS.128, 64 FMAs).
    #    A is strictly lower triangular, so rows and columns past the chunk's length stay zero.
    block = cuda.local.array(TILE_ENTRIES_2D, float32)
    a_block = cuda.local.array(TILE_ENTRIES_2D, float32)
    t_block = cuda.local.array(TILE_ENTRIES_2D, float32)
    for r in range(TILE_ENTRIES):
        for c in range(TILE_ENTRIES):
            i = TILE_ENTRIES * ti + r
            block[TILE_ENTRIES * r + c] = ONE if i == TILE_ENTRIES * tj + c and i < length else ZERO
    cuda.syncthreads()  # A complete
    for k in range(side):
        if ti == k:
            for r in range(1, TILE_ENTRIES):
                for s in range(r):
                    a_rs = stage[(TILE_ENTRIES * k + r) * WIDE_STRIDE + TILE_ENTRIES * k + s]
                    for c in range(TILE_ENTRIES):
                        block[TILE_ENTRIES * r + c] -= a_rs * block[TILE_ENTRIES * s + c]
            for r in range(TILE_ENTRIES):
                store_shared_f32x4(tmat, (TILE_ENTRIES * k + r) * WIDE_STRIDE + TILE_ENTRIES * tj,
                                   block[4 * r], block[4 * r + 1], block[4 * r + 2], block[4 * r + 3])  # fmt: skip
        cuda.syncthreads()  # block row k of T published
        if ti > k:
            for r in range(TILE_ENTRIES):
                index = (TILE_ENTRIES * ti + r) * WIDE_STRIDE + TILE_ENTRIES * k
                a_block[4 * r], a_block[4 * r + 1], a_block[4 * r + 2], a_block[4 * r + 3] = load_shared_f32x4(
                    stage, index
                )
                index = (TILE_ENTRIES * k + r) * WIDE_STRIDE + TILE_ENTRIES * tj
                t_block[4 * r], t_block[4 * r + 1], t_block[4 * r + 2], t_block[4 * r + 3] = load_shared_f32x4(
                    tmat, index
                )
            for r in range(TILE_ENTRIES):
                for s in range(TILE_ENTRIES):
                    for c in range(TILE_ENTRIES):
                        block[TILE_ENTRIES * r + c] -= a_block[TILE_ENTRIES * r + s] * t_block[TILE_ENTRIES * s + c]

    # 5. W = T diag(beta e^gamma) K -> w, U = T diag(beta) V -> out, C columns of [K' | V'] staged at a time;
    #    thread rows ti + side*a, columns 4tj..4tj+3: per 4 rows of the stage 8 LDS.128 for 64 FMAs. T is lower
    #    triangular, so a thread stops at its last row.
    acc = cuda.local.array(TILE_ENTRIES_2D, float32)
    t_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    s_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    quads_log2 = log2(chunk // 4)
    m_end = min(length, ti + side * (TILE_ENTRIES - 1) + 1)
    m_end = (m_end + 3) // 4 * 4
    base = 0
    while base < k_dim + v_dim:
        cuda.syncthreads()  # T complete / A or the previous tile consumed
        e = thread
        while e < chunk << quads_log2:
            m = e >> quads_log2
            g = base + 4 * (e & ((1 << quads_log2) - 1))  # column of [K | V]
            x0 = x1 = x2 = x3 = ZERO
            if m < length:
                row = (t0 + m) * conv_dim
                if g < k_dim:
                    x0, x1, x2, x3 = load_f32x4(mixed, row + k_column + g)
                    scale = key_scale[m]
                elif g < k_dim + v_dim:
                    x0, x1, x2, x3 = load_f32x4(mixed, row + v_column + g - k_dim)
                    scale = beta_shared[m]
                else:
                    scale = ZERO
                x0 *= scale
                x1 *= scale
                x2 *= scale
                x3 *= scale
            store_shared_f32x4(stage, m * WIDE_STRIDE + g - base, x0, x1, x2, x3)
            e += threads
        cuda.syncthreads()
        for e in range(TILE_ENTRIES_2D):
            acc[e] = ZERO
        for m in range(0, m_end, 4):
            for a in range(TILE_ENTRIES):
                r = (ti + side * a) * WIDE_STRIDE + m
                t_rows[4 * a], t_rows[4 * a + 1], t_rows[4 * a + 2], t_rows[4 * a + 3] = load_shared_f32x4(tmat, r)
                r = (m + a) * WIDE_STRIDE + 4 * tj
                s_rows[4 * a], s_rows[4 * a + 1], s_rows[4 * a + 2], s_rows[4 * a + 3] = load_shared_f32x4(stage, r)
            for a in range(TILE_ENTRIES):
                for b in range(4):
                    for d in range(4):
                        acc[4 * a + b] += t_rows[4 * a + d] * s_rows[4 * d + b]
        g = base + 4 * tj
        for a in range(TILE_ENTRIES):
            i = ti + side * a
            if i < length:
                if g < k_dim:
                    index = (head * tokens + t0 + i) * k_dim + g
                    store_f32x4(w, index, acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3])
                elif g < k_dim + v_dim:
                    index = (t0 + i) * out_width + head * v_dim + g - k_dim
                    store_f32x4(out, index, acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3])
        base += chunk
