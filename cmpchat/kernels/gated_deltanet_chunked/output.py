"""`gdn_chunk_output`: each chunk's outputs from its start state and its intra-chunk terms (launch 4)."""

from __future__ import annotations

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import load_f32x4, load_global_f32x4, load_shared_f32x4, store_f32x4, store_shared_f32x4
from cmpchat.kernels.gated_deltanet_chunked.common import (
    ALIGN,
    MAX_CHUNK,
    OUTPUT_COLUMNS,
    OUTPUT_Q,
    OUTPUT_QUADS_LOG2,
    OUTPUT_S,
    OUTPUT_STRIDE,
    OUTPUT_THREADS,
    STAGE_BATCH,
    STAGE_VALUES,
    TILE_ENTRIES,
    TILE_ENTRIES_2D,
    WIDE_STRIDE,
    ZERO,
    log2,
)

_OUTPUT_SIGNATURE = (
    "void(float32[::1], float32[::1], float32[:, :, ::1], float32[::1], float32[::1], int32, int32, int32, int32)"
)


@cuda.jit(device=True, inline=True)
def _stage_tile(tile, stride, source, first, row_stride, rows, valid_rows, quads_log2, coherent, thread, threads):
    """tile[row * stride + ...] <- source[first + row * row_stride + ...]: a [rows x 4*2^quads_log2] tile into
    shared memory, zeros from row `valid_rows` (>= 1) on. A thread issues STAGE_BATCH 16-byte loads before it
    stores any, so staging waits one memory latency per batch, not one per load; `coherent` loads data this
    kernel overwrites later. Threads keep their quad and step down the rows (`threads` a multiple of the quads)."""
    rows_per_pass = threads >> quads_log2
    quad = 4 * (thread & ((1 << quads_log2) - 1))
    values = cuda.local.array(STAGE_VALUES, float32)
    first_row = thread >> quads_log2
    while first_row < rows:
        row = first_row
        for n in range(STAGE_BATCH):
            x0 = x1 = x2 = x3 = ZERO
            if row < valid_rows:
                index = first + row * row_stride + quad
                if coherent:
                    x0, x1, x2, x3 = load_global_f32x4(source, index)
                else:
                    x0, x1, x2, x3 = load_f32x4(source, index)
            values[4 * n], values[4 * n + 1], values[4 * n + 2], values[4 * n + 3] = x0, x1, x2, x3
            row += rows_per_pass
        row = first_row
        for n in range(STAGE_BATCH):
            if row < rows:
                store_shared_f32x4(tile, row * stride + quad, values[4 * n], values[4 * n + 1], values[4 * n + 2],
                                   values[4 * n + 3])  # fmt: skip
            row += rows_per_pass
        first_row += STAGE_BATCH * rows_per_pass


@kernel(_OUTPUT_SIGNATURE, launch_bounds=OUTPUT_THREADS)
def gdn_chunk_output(mixed, qk, decay, states, out, num_k_heads, k_dim, v_dim, chunk):
    """Block (32 value columns, value head, chunk), 2C threads: o = e^gamma Q S_c + (M o Q K^T) Delta over
    Delta in `out`. Thread tile rows rg + (C/4)a, columns 4cq..4cq+3. `mixed`, `qk`, `states`, `out` are flat."""
    thread = cuda.threadIdx.x
    threads = cuda.blockDim.x
    col0 = cuda.blockIdx.x * OUTPUT_COLUMNS
    head = cuda.blockIdx.y
    chunk_index = cuda.blockIdx.z
    num_v_heads = decay.shape[0]
    tokens = decay.shape[1]
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    out_width = num_v_heads * v_dim
    q_column = (head % num_k_heads) * k_dim
    t0 = chunk_index * chunk
    length = min(chunk, tokens - t0)
    side = chunk // 4
    rg = thread // 8
    cq = thread % 8

    q_stage = cuda.shared.array(OUTPUT_Q, float32, alignment=ALIGN)  # Q [C][64 + 4], then M o Q K^T
    s_stage = cuda.shared.array(OUTPUT_S, float32, alignment=ALIGN)  # S_c [64][32 + 4], then Delta
    acc = cuda.local.array(TILE_ENTRIES_2D, float32)
    a_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    b_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    for e in range(TILE_ENTRIES_2D):
        acc[e] = ZERO
    state_first = (chunk_index * num_v_heads + head) * k_dim

    # Q S_c, 64 key dims staged at a time: per 4 dims 8 LDS.128 for 64 FMAs.
    for base in range(0, k_dim, MAX_CHUNK):
        width = min(MAX_CHUNK, k_dim - base)
        quads_log2 = log2(width // 4)
        cuda.syncthreads()
        _stage_tile(q_stage, WIDE_STRIDE, mixed, t0 * conv_dim + q_column + base, conv_dim, chunk, length,
                    quads_log2, False, thread, threads)  # fmt: skip
        _stage_tile(s_stage, OUTPUT_STRIDE, states, (state_first + base) * v_dim + col0, v_dim, width, width,
                    OUTPUT_QUADS_LOG2, False, thread, threads)  # fmt: skip
        cuda.syncthreads()
        for c in range(0, width, 4):
            for a in range(TILE_ENTRIES):
                r = (rg + side * a) * WIDE_STRIDE + c
                a_rows[4 * a], a_rows[4 * a + 1], a_rows[4 * a + 2], a_rows[4 * a + 3] = load_shared_f32x4(q_stage, r)
                r = (c + a) * OUTPUT_STRIDE + 4 * cq
                b_rows[4 * a], b_rows[4 * a + 1], b_rows[4 * a + 2], b_rows[4 * a + 3] = load_shared_f32x4(s_stage, r)
            for a in range(TILE_ENTRIES):
                for b in range(4):
                    for d in range(4):
                        acc[4 * a + b] += a_rows[4 * a + d] * b_rows[4 * d + b]
    for a in range(TILE_ENTRIES):
        i = rg + side * a
        if i < length:
            scale = decay[head, t0 + i, 0]  # e^gamma_i
            for b in range(4):
                acc[4 * a + b] *= scale
    cuda.syncthreads()

    # + (M o Q K^T) Delta: stage the chunk's C x C matrix and Delta (read whole before o replaces it).
    quads_log2 = log2(chunk // 4)
    qk_first = (head * ((tokens + chunk - 1) // chunk) + chunk_index) * chunk * chunk
    _stage_tile(q_stage, WIDE_STRIDE, qk, qk_first, chunk, chunk, chunk, quads_log2, False, thread, threads)
    _stage_tile(s_stage, OUTPUT_STRIDE, out, t0 * out_width + head * v_dim + col0, out_width, chunk, length,
                OUTPUT_QUADS_LOG2, True, thread, threads)  # fmt: skip
    cuda.syncthreads()
    m_end = min(length, rg + side * (TILE_ENTRIES - 1) + 1)  # M o Q K^T is lower triangular
    m_end = (m_end + 3) // 4 * 4
    for m in range(0, m_end, 4):
        for a in range(TILE_ENTRIES):
            r = (rg + side * a) * WIDE_STRIDE + m
            a_rows[4 * a], a_rows[4 * a + 1], a_rows[4 * a + 2], a_rows[4 * a + 3] = load_shared_f32x4(q_stage, r)
            r = (m + a) * OUTPUT_STRIDE + 4 * cq
            b_rows[4 * a], b_rows[4 * a + 1], b_rows[4 * a + 2], b_rows[4 * a + 3] = load_shared_f32x4(s_stage, r)
        for a in range(TILE_ENTRIES):
            for b in range(4):
                for d in range(4):
                    acc[4 * a + b] += a_rows[4 * a + d] * b_rows[4 * d + b]
    for a in range(TILE_ENTRIES):
        i = rg + side * a
        if i < length:
            index = (t0 + i) * out_width + head * v_dim + col0 + 4 * cq
            store_f32x4(out, index, acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3])
