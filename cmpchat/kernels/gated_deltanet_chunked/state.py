"""`gdn_chunk_state`: the one sequential pass over the chunks, carrying the recurrent state (launch 3)."""

from __future__ import annotations

from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import load_f32x4, load_shared_f32x4, store_f32x4, store_shared_f32x4
from cmpchat.kernels.gated_deltanet_chunked.common import (
    ALIGN,
    DELTA_SLICE,
    PREFETCH,
    PREFETCH_VALUES,
    STATE_COLUMNS,
    STATE_SLICE,
    STATE_THREADS,
    STATE_TILE,
    TILE_ENTRIES,
    TILE_ENTRIES_2D,
    ZERO,
    log2,
)

_STATE_SIGNATURE = (
    "void(float32[::1], float32[::1], float32[:, :, ::1], float32[::1], float32[::1], "
    "float32[:, :, :, ::1], int32, int32, int32)"
)


@cuda.jit(device=True, inline=True)
def _fetch_tile(values, source, first, row_stride, rows, quads_log2, thread, threads):
    """values <- a [rows x 4*2^quads_log2] tile at source[first + row*row_stride + ...] (zero past `rows`, up to the
    chunk's length), 16 bytes per load, each warp reading whole rows. `threads` is a multiple of the row's quads,
    so a thread keeps its quad and steps down the rows: one address increment per load."""
    rows_per_pass = threads >> quads_log2
    row = thread >> quads_log2
    index = first + row * row_stride + 4 * (thread & ((1 << quads_log2) - 1))
    for n in range(PREFETCH):
        x0 = x1 = x2 = x3 = ZERO
        if row < rows:
            x0, x1, x2, x3 = load_f32x4(source, index)
        values[4 * n] = x0
        values[4 * n + 1] = x1
        values[4 * n + 2] = x2
        values[4 * n + 3] = x3
        row += rows_per_pass
        index += rows_per_pass * row_stride


@cuda.jit(device=True, inline=True)
def _store_tile(values, tile, stride, quads_log2, chunk, thread, threads):
    """The fetched tile into shared memory (rows of stride dk + 4), all C rows (zeros past the tokens)."""
    rows_per_pass = threads >> quads_log2
    row = thread >> quads_log2
    index = row * stride + 4 * (thread & ((1 << quads_log2) - 1))
    for n in range(PREFETCH):
        if row < chunk:
            store_shared_f32x4(tile, index, values[4 * n], values[4 * n + 1], values[4 * n + 2], values[4 * n + 3])
        row += rows_per_pass
        index += rows_per_pass * stride


@kernel(_STATE_SIGNATURE, launch_bounds=STATE_THREADS)
def gdn_chunk_state(mixed, w, decay, out, states, delta_state, slot, num_k_heads, chunk):
    """Block (value head, 16 columns of S), max(2C, dk) threads: the chunks in order, the only sequential launch.

    Per chunk: states[c] <- S; Delta = U - W S over U in `out`; S <- e^gamma_L S + K^T diag(e^(gamma_L -
    gamma)) Delta. `mixed` [T*conv_dim], `w` [Hv*T*dk], `out` [T*Hv*dv], `states` [chunks*Hv*dk*dv] are flat.
    """
    thread = cuda.threadIdx.x
    threads = cuda.blockDim.x
    head = cuda.blockIdx.x
    col0 = cuda.blockIdx.y * STATE_COLUMNS
    num_v_heads = delta_state.shape[1]
    k_dim = delta_state.shape[2]
    v_dim = delta_state.shape[3]
    tokens = decay.shape[1]
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    out_width = num_v_heads * v_dim
    k_column = (num_k_heads + head % num_k_heads) * k_dim
    chunks = (tokens + chunk - 1) // chunk
    quads_log2 = log2(k_dim // 4)
    stride = k_dim + 4  # tile rows 4 banks apart: the 8 rows a warp reads hit distinct banks
    # Delta (phase 1, threads < 2C): rows rg + side*a, columns 4cq..4cq+3, key dims of half `half` (the
    # halves summed through d_shared).
    side = chunk // 4
    half = thread // chunk
    if half > 1:
        half = 2  # no share of phase 1
    rg = (thread % chunk) // 4
    cq = thread % 4
    # S (phase 2, in registers): rows 4rq..4rq+3, columns 4cq..4cq+3.
    rq = thread // 4
    owner = 4 * rq < k_dim

    tile = cuda.shared.array(STATE_TILE, float32, alignment=ALIGN)  # W of the chunk, then its K
    s_shared = cuda.shared.array(STATE_SLICE, float32, alignment=ALIGN)  # S [dk][16]
    d_shared = cuda.shared.array(DELTA_SLICE, float32, alignment=ALIGN)  # partial Delta, then scaled Delta
    fetched = cuda.local.array(PREFETCH_VALUES, float32)
    state = cuda.local.array(TILE_ENTRIES_2D, float32)
    acc = cuda.local.array(TILE_ENTRIES_2D, float32)
    u = cuda.local.array(TILE_ENTRIES_2D, float32)
    w_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    s_rows = cuda.local.array(TILE_ENTRIES_2D, float32)
    decay_out = cuda.local.array(TILE_ENTRIES, float32)

    head_state = delta_state[slot, head]
    if owner:
        for a in range(TILE_ENTRIES):
            r = 4 * rq + a
            for b in range(4):
                state[4 * a + b] = head_state[r, col0 + 4 * cq + b]
            store_shared_f32x4(s_shared, r * STATE_COLUMNS + 4 * cq, state[4 * a], state[4 * a + 1],
                               state[4 * a + 2], state[4 * a + 3])  # fmt: skip
            index = (head * k_dim + r) * v_dim + col0 + 4 * cq  # states[0, head, r, ...]
            store_f32x4(states, index, state[4 * a], state[4 * a + 1], state[4 * a + 2], state[4 * a + 3])
    _fetch_tile(fetched, w, head * tokens * k_dim, k_dim, min(chunk, tokens), quads_log2, thread, threads)
    _store_tile(fetched, tile, stride, quads_log2, chunk, thread, threads)
    _fetch_tile(fetched, mixed, k_column, conv_dim, min(chunk, tokens), quads_log2, thread, threads)
    cuda.syncthreads()

    for chunk_index in range(chunks):
        t0 = chunk_index * chunk
        length = min(chunk, tokens - t0)
        following = chunk_index + 1 < chunks
        next_length = min(chunk, tokens - t0 - chunk)
        chunk_decay = decay[head, t0 + length - 1, 0]
        if half == 0:  # U and e^(gamma_L - gamma_i) of this thread's rows, in flight during phase 1
            for a in range(TILE_ENTRIES):
                i = rg + side * a
                decay_out[a] = ZERO
                for b in range(4):
                    u[4 * a + b] = ZERO
                if i < length:
                    decay_out[a] = decay[head, t0 + i, 1]
                    index = (t0 + i) * out_width + head * v_dim + col0 + 4 * cq
                    for b in range(4):
                        u[4 * a + b] = out[index + b]

        # Phase 1: this half's share of W S for a 4x4 tile of Delta: per 4 key dims 8 LDS.128 for 64 FMAs.
        for e in range(TILE_ENTRIES_2D):
            acc[e] = ZERO
        first = half * (k_dim // 2)
        for step in range(k_dim // 8 if half <= 1 else 0):
            c = first + 4 * step
            for a in range(TILE_ENTRIES):
                r = (rg + side * a) * stride + c
                w_rows[4 * a], w_rows[4 * a + 1], w_rows[4 * a + 2], w_rows[4 * a + 3] = load_shared_f32x4(tile, r)
                r = (c + a) * STATE_COLUMNS + 4 * cq
                s_rows[4 * a], s_rows[4 * a + 1], s_rows[4 * a + 2], s_rows[4 * a + 3] = load_shared_f32x4(s_shared, r)
            for a in range(TILE_ENTRIES):
                for b in range(4):
                    for d in range(4):
                        acc[4 * a + b] += w_rows[4 * a + d] * s_rows[4 * d + b]
        if half == 1:
            for a in range(TILE_ENTRIES):
                index = (rg + side * a) * STATE_COLUMNS + 4 * cq
                store_shared_f32x4(d_shared, index, acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3])
        cuda.syncthreads()  # partials visible; W consumed

        if half == 0:  # Delta = U - W S into out (over U) and e^(gamma_L - gamma_i) Delta_i into d_shared
            for a in range(TILE_ENTRIES):
                i = rg + side * a
                index = i * STATE_COLUMNS + 4 * cq
                p0, p1, p2, p3 = load_shared_f32x4(d_shared, index)
                d0 = u[4 * a] - (acc[4 * a] + p0)
                d1 = u[4 * a + 1] - (acc[4 * a + 1] + p1)
                d2 = u[4 * a + 2] - (acc[4 * a + 2] + p2)
                d3 = u[4 * a + 3] - (acc[4 * a + 3] + p3)
                if i < length:
                    store_f32x4(out, (t0 + i) * out_width + head * v_dim + col0 + 4 * cq, d0, d1, d2, d3)
                scale = decay_out[a]
                store_shared_f32x4(d_shared, index, d0 * scale, d1 * scale, d2 * scale, d3 * scale)
        _store_tile(fetched, tile, stride, quads_log2, chunk, thread, threads)  # K of this chunk
        if following:
            first = (head * tokens + t0 + chunk) * k_dim
            _fetch_tile(fetched, w, first, k_dim, next_length, quads_log2, thread, threads)
        cuda.syncthreads()

        # Phase 2: S <- e^gamma_L S + K^T D for this thread's 4x4 tile of S: per token 2 LDS.128, 16 FMAs, four
        #    tokens a step (the tiles' rows past the chunk's length are zeros), their loads issued together.
        if owner:
            for e in range(TILE_ENTRIES_2D):
                state[e] *= chunk_decay
            k_index = 4 * rq
            d_index = 4 * cq
            for _ in range(0, length, 4):
                for t in range(4):
                    k0, k1, k2, k3 = load_shared_f32x4(tile, k_index + t * stride)
                    e0, e1, e2, e3 = load_shared_f32x4(d_shared, d_index + t * STATE_COLUMNS)
                    state[0] += k0 * e0
                    state[1] += k0 * e1
                    state[2] += k0 * e2
                    state[3] += k0 * e3
                    state[4] += k1 * e0
                    state[5] += k1 * e1
                    state[6] += k1 * e2
                    state[7] += k1 * e3
                    state[8] += k2 * e0
                    state[9] += k2 * e1
                    state[10] += k2 * e2
                    state[11] += k2 * e3
                    state[12] += k3 * e0
                    state[13] += k3 * e1
                    state[14] += k3 * e2
                    state[15] += k3 * e3
                k_index += 4 * stride
                d_index += 4 * STATE_COLUMNS
            for a in range(TILE_ENTRIES):
                r = 4 * rq + a
                store_shared_f32x4(s_shared, r * STATE_COLUMNS + 4 * cq, state[4 * a], state[4 * a + 1],
                                   state[4 * a + 2], state[4 * a + 3])  # fmt: skip
                if following:
                    index = (((chunk_index + 1) * num_v_heads + head) * k_dim + r) * v_dim + col0 + 4 * cq
                    store_f32x4(states, index, state[4 * a], state[4 * a + 1], state[4 * a + 2], state[4 * a + 3])
        cuda.syncthreads()  # K and D consumed
        if following:
            _store_tile(fetched, tile, stride, quads_log2, chunk, thread, threads)  # W of the next chunk
            first = (t0 + chunk) * conv_dim + k_column
            _fetch_tile(fetched, mixed, first, conv_dim, next_length, quads_log2, thread, threads)
        cuda.syncthreads()

    if owner:
        for a in range(TILE_ENTRIES):
            for b in range(4):
                head_state[4 * rq + a, col0 + 4 * cq + b] = state[4 * a + b]
