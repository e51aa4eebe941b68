"""Gated DeltaNet prefill: the T tokens of one prompt through one GDN layer, chunked (WY / UT transform) or
token by token, in fp32 on CUDA cores (QWEN35.md "Gated DeltaNet"; the algorithm and its numerical safety are
in `cmpchat.backends.reference.gated_deltanet_chunked`, its numpy reference).

Buffers are the decode step's (`gated_deltanet`): `projection [T, P]` (qkv | z | b | a per token),
`conv_state [S, K-1, conv_dim]` and `delta_state [S, Hv, dk, dv]` fp32 (slot `slot` is read and updated in
place), `out [T, Hv*dv]` = RMSNorm(o_h) * ssm_norm.weight * silu(z_h). Plus `mixed [T, conv_dim]` (the conv's
output; unlike decode it cannot overwrite the projection, as the conv of token t reads the raw inputs of
t-K+1..t, which other blocks would be overwriting) and, for the chunked path, a `ChunkWorkspace`.

Launches, chunked (`prefill_launches(..., chunked=True)`):
1. `gdn_prefill_conv`, grid (2Hk+Hv heads, ceil(T/16)), one thread per channel of a head, 16 tokens per block:
   causal depthwise conv over [conv_state | raw inputs], SiLU, q/k L2 norm and q scaling, as
   `gdn_conv_step` per token (each token's sum of squares summed by one thread from shared memory: two
   barriers per block); the blocks of the first 16 tokens (the only readers of the old conv state) then
   write the new conv state (the last K-1 raw inputs; old entries shift when T < K-1).
2. `gdn_chunk_prepare`, grid (chunks, Hv), (C/4)^2 threads (256 for C = 64), fully parallel over chunks:
   beta, g and the compensated cumulative log decays; the Gram matrices K K^T and Q K^T (register tiles of
   4x4 per thread over dk staged C/2 columns at a time); A; T = (I + A)^-1 by forward substitution in shared
   memory (one barrier per row); the WY factors W = T diag(beta e^gamma) K -> workspace.w and
   U = T diag(beta) V -> `out` (U lives there until launch 3 replaces it with o, in the same block that
   reads it); the masked decayed Q K^T -> workspace.qk; e^gamma_i and e^(gamma_L - gamma_i) -> workspace.decay.
3. `gdn_chunk_recurrence`, grid (Hv, dv/32), block (32 columns, dk/16 row groups) = 256 threads: the only
   sequential part. The columns of S are independent, so each block owns a 32-column slice of one head's
   state, kept in shared memory (dk x 32 fp32 = 16 KB) across the chunks. Per chunk:
   (A) thread (j, g) computes rows i = g (mod dk/16) of Delta = U - W S and of e^gamma Q S (W and Q rows
       read as warp-uniform 16-byte loads, S from shared), (B) o = e^gamma Q S + (M o Q K^T) Delta into `out`,
   (C) S <- e^gamma_L S + K^T diag(e^(gamma_L - gamma)) Delta for its 16 rows x 1 column; two barriers.
4. `gdn_prefill_gated_norm`, grid (Hv, ceil(T/16)), dv threads, 16 tokens per block:
   out = RMSNorm(o) * weight * silu(z), in place.

Token by token (`chunked=False`): launches 1 and 4 with `gdn_prefill_sequential` in between: grid (Hv, dv/32),
block (32, dk/16), the state slice in registers (16 per thread) for all T tokens, q/k of 16 tokens staged
at a time, one barrier per token (u = S'^T k, S'^T q and k.q reduced together; o = S'^T q + (k.q) delta).

Static shared memory (sm_70 allows 48 KB): prepare 34.5 KB, recurrence 32 KB, sequential 24.7 KB, conv and
norm 16.5 KB; all for dk <= 128, C <= 64. ptxas for sm_70 (CUDA 12.9), registers per thread, no spills:
conv 56, prepare 126, recurrence 128, sequential 94, norm 55. No tensor-core instruction (DESIGN.md).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32

from cmpchat.cuda.compile import kernel
from cmpchat.cuda.intrinsics import load_f32x4
from cmpchat.cuda.kernels.elementwise import sigmoid, silu, softplus
from cmpchat.cuda.kernels.gated_deltanet import (
    L2_NORM_EPS,
    MAX_HEAD_DIM,
    ROWS_PER_THREAD,
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    decode_step,
)
from cmpchat.cuda.launch import Launch, check_array

DEFAULT_CHUNK = 64
CHUNK_SIZES = (8, 16, 32, 64)
"""Chunk lengths the kernels take: (C/4)^2 threads build a chunk's C x C matrices in 4x4 register tiles."""
MAX_CHUNK = 64
MAX_KEY_DIM = 128
"""The shared-memory budget (48 KB static on sm_70) is laid out for dk <= 128 (all released sizes)."""
COLUMN_TILE = 32
"""State columns (value dims) per block of the recurrence kernels: one warp-wide row of threads."""
MAX_GROUPS = MAX_KEY_DIM // ROWS_PER_THREAD
SLAB_ROWS = 8
"""Rows of Delta (and of Q S) each recurrence thread accumulates at once: 8 * dk/16 rows of a chunk per slab."""
CONV_TOKENS = 16
NORM_TOKENS = 16
STAGED_TOKENS = 16
"""Tokens whose q/k the token-by-token kernel stages in shared memory per barrier pair."""
RECURRENCE_THREADS = COLUMN_TILE * MAX_GROUPS
TILE_ENTRIES = 4
"""Each prepare thread owns a 4x4 tile of the chunk's C x C matrices (rows ti + C/4 * a, cols tj + C/4 * b)."""

_TRI_STRIDE = MAX_CHUNK + 1  # padded rows: column walks hit distinct banks
_TILE_STRIDE = MAX_CHUNK // 2 + 1
_ROW_STRIDE = MAX_HEAD_DIM + 1  # per-token rows of squares, summed along by one thread each
_ZERO = float32(0.0)
_ONE = float32(1.0)
# Array sizes as plain constants (Numba types a shared/local array's size only from a literal or a global).
_CONV_SQUARES = CONV_TOKENS * _ROW_STRIDE
_NORM_SQUARES = NORM_TOKENS * _ROW_STRIDE
_TRI_SIZE = MAX_CHUNK * _TRI_STRIDE
_TILE_SIZE = MAX_CHUNK * _TILE_STRIDE
_TILE_ENTRIES_2D = TILE_ENTRIES * TILE_ENTRIES
_TILE_OUTPUTS = 2 * TILE_ENTRIES
_STATE_SLICE = MAX_KEY_DIM * COLUMN_TILE
_CHUNK_SLICE = MAX_CHUNK * COLUMN_TILE
_STAGED_KEYS = STAGED_TOKENS * MAX_KEY_DIM
_STAGED_VALUES = STAGED_TOKENS * COLUMN_TILE
_PARTIALS = 2 * 3 * MAX_GROUPS * COLUMN_TILE  # u, S'^T q and k.q per row group, double-buffered

_CONV_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, ::1], int32, int32, int32, int32, float32)"
)
_PREPARE_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, :, ::1], "
    "float32[:, :, :, ::1], float32[:, :, ::1], float32[:, ::1], int32, int32)"
)
_RECURRENCE_SIGNATURE = (
    "void(float32[::1], float32[::1], float32[:, :, :, ::1], float32[:, :, ::1], float32[:, ::1], "
    "float32[:, :, :, ::1], int32, int32, int32)"
)
_SEQUENTIAL_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, :, :, ::1], "
    "float32[:, ::1], int32, int32)"
)
_NORM_SIGNATURE = "void(float32[:, ::1], float32[::1], float32[:, ::1], float32)"


# -- kernels -----------------------------------------------------------------------------------------


@kernel(_CONV_SIGNATURE)
def gdn_prefill_conv(projection, conv_weight, conv_state, mixed, slot, num_k_heads, k_head_dim, v_head_dim, q_scale):
    """Block (head, 16-token tile), thread = channel of the head: heads 0..Hk-1 are q, Hk..2Hk-1 are k, then
    the Hv value heads. Each q/k token's sum of squares goes through shared memory (two barriers a tile)."""
    lane = cuda.threadIdx.x
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
    squares = cuda.shared.array(_CONV_SQUARES, float32)
    norms = cuda.shared.array(CONV_TOKENS, float32)
    for s in range(CONV_TOKENS):
        t = first + s
        value = _ZERO
        if lane < width and t < tokens:
            total = _ZERO
            for tap in range(taps):  # tap 0 is the oldest input, tap K-1 the current one (the reference's order)
                source = t - history + tap
                if source >= 0:
                    x = projection[source, channel]
                else:  # before the prompt: the carried raw inputs (only the first tile gets here)
                    x = conv_state[slot, history + source, channel]
                total += x * conv_weight[channel, tap]
            value = silu(total)
            mixed[t, channel] = value
        squares[s * _ROW_STRIDE + lane] = value * value
    if head < qk_heads:  # uniform over the block: L2 norm of each token's head, then q's scale
        cuda.syncthreads()
        if lane < CONV_TOKENS:
            total = _ZERO
            for c in range(width):
                total += squares[lane * _ROW_STRIDE + c]
            norms[lane] = float32(math.sqrt(total + L2_NORM_EPS))
        cuda.syncthreads()
        for s in range(CONV_TOKENS):
            t = first + s
            if lane < width and t < tokens:
                value = mixed[t, channel] / norms[s]  # this thread's own write above
                if head < num_k_heads:
                    value *= q_scale
                mixed[t, channel] = value
    if cuda.blockIdx.y == 0 and lane < width:
        # The new state is entries T..T+K-2 of [old state | inputs]. This thread alone reads and writes this
        # channel's state (the conv above included), and old entry m+T is read (for entry m) before it is
        # itself overwritten.
        for m in range(history):
            source = tokens - history + m
            if source >= 0:
                conv_state[slot, m, channel] = projection[source, channel]
            else:
                conv_state[slot, m, channel] = conv_state[slot, m + tokens, channel]


@kernel(_PREPARE_SIGNATURE)
def gdn_chunk_prepare(projection, mixed, ssm_a, dt_bias, w, qk, decay, out, num_k_heads, chunk):
    """Block (chunk, value head), (C/4)^2 threads: the chunk's WY factors, masked Q K^T and decays."""
    thread = cuda.threadIdx.x
    threads = cuda.blockDim.x
    chunk_index = cuda.blockIdx.x
    head = cuda.blockIdx.y
    tokens = projection.shape[0]
    num_v_heads = ssm_a.shape[0]
    k_dim = w.shape[2]
    v_dim = out.shape[1] // num_v_heads
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
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
    width = chunk // 2  # columns of K, Q, V staged at a time: 2 per thread column

    log_hi = cuda.shared.array(MAX_CHUNK, float32)
    log_lo = cuda.shared.array(MAX_CHUNK, float32)
    beta_shared = cuda.shared.array(MAX_CHUNK, float32)
    key_scale = cuda.shared.array(MAX_CHUNK, float32)
    tri = cuda.shared.array(_TRI_SIZE, float32)  # A^T above the diagonal, T below
    tile_a = cuda.shared.array(_TILE_SIZE, float32)
    tile_b = cuda.shared.array(_TILE_SIZE, float32)

    # 1. Gates, and gamma_i = g_1 + ... + g_i as compensated sums (hi + lo): see the reference's docstring.
    for i in range(thread, length, threads):
        t = t0 + i
        beta_shared[i] = sigmoid(projection[t, b_column])
        log_hi[i] = ssm_a[head] * softplus(projection[t, a_column] + dt_bias[head])  # g <= 0
    cuda.syncthreads()
    if thread == 0:
        total = _ZERO
        error = _ZERO
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
    for i in range(thread, length, threads):
        decay_in = float32(math.exp(log_hi[i] + log_lo[i]))  # every exponent here is <= 0
        decay[head, t0 + i, 0] = decay_in
        decay[head, t0 + i, 1] = float32(math.exp((last_hi - log_hi[i]) + (last_lo - log_lo[i])))
        key_scale[i] = beta_shared[i] * decay_in

    # 2. Gram matrices K K^T and Q K^T, thread tile rows ti + side*a, columns tj + side*b.
    kk = cuda.local.array(_TILE_ENTRIES_2D, float32)
    qk_acc = cuda.local.array(_TILE_ENTRIES_2D, float32)
    row_k = cuda.local.array(TILE_ENTRIES, float32)
    row_q = cuda.local.array(TILE_ENTRIES, float32)
    col_k = cuda.local.array(TILE_ENTRIES, float32)
    for e in range(TILE_ENTRIES * TILE_ENTRIES):
        kk[e] = _ZERO
        qk_acc[e] = _ZERO
    for base in range(0, k_dim, width):
        cuda.syncthreads()  # the previous tile is consumed
        for e in range(thread, chunk * width, threads):
            i = e // width
            col = e % width
            k_value = _ZERO
            q_value = _ZERO
            if i < length:
                k_value = mixed[t0 + i, k_column + base + col]
                q_value = mixed[t0 + i, q_column + base + col]
            tile_a[i * _TILE_STRIDE + col] = k_value
            tile_b[i * _TILE_STRIDE + col] = q_value
        cuda.syncthreads()
        for col in range(width):
            for a in range(TILE_ENTRIES):
                row_k[a] = tile_a[(ti + side * a) * _TILE_STRIDE + col]
                row_q[a] = tile_b[(ti + side * a) * _TILE_STRIDE + col]
                col_k[a] = tile_a[(tj + side * a) * _TILE_STRIDE + col]
            for a in range(TILE_ENTRIES):
                for b in range(TILE_ENTRIES):
                    kk[a * TILE_ENTRIES + b] += row_k[a] * col_k[b]
                    qk_acc[a * TILE_ENTRIES + b] += row_q[a] * col_k[b]

    # 3. A_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (j < i) into tri[j][i]; T's strict lower part cleared;
    #    the masked, decayed Q K^T out to the workspace (zero above the diagonal and past the chunk's end).
    for a in range(TILE_ENTRIES):
        i = ti + side * a
        for b in range(TILE_ENTRIES):
            j = tj + side * b
            factor = _ZERO
            if j <= i and i < length:
                factor = float32(math.exp((log_hi[i] - log_hi[j]) + (log_lo[i] - log_lo[j])))
            qk[head, chunk_index, i, j] = factor * qk_acc[a * TILE_ENTRIES + b]
            if j < i:
                a_ij = _ZERO
                if i < length:
                    a_ij = beta_shared[i] * factor * kk[a * TILE_ENTRIES + b]
                tri[j * _TRI_STRIDE + i] = a_ij
                tri[i * _TRI_STRIDE + j] = _ZERO
    cuda.syncthreads()

    # 4. T = (I + A)^-1, right-looking: once row m of T is final, every later row i takes
    #    T[i, c] -= A[i, m] T[m, c] for c <= m (T[m, m] = 1). Reads row m and A's column m (stored as tri's
    #    row m above the diagonal); writes only rows below m.
    for m in range(length - 1):
        for a in range(TILE_ENTRIES):
            i = ti + side * a
            if m < i and i < length:
                a_im = tri[m * _TRI_STRIDE + i]
                for b in range(TILE_ENTRIES):
                    c = tj + side * b
                    if c < m:
                        tri[i * _TRI_STRIDE + c] -= a_im * tri[m * _TRI_STRIDE + c]
                    elif c == m:
                        tri[i * _TRI_STRIDE + c] -= a_im
        cuda.syncthreads()
    for a in range(TILE_ENTRIES):  # T's unit diagonal and zero upper triangle, so products read it plainly
        i = ti + side * a
        for b in range(TILE_ENTRIES):
            c = tj + side * b
            if c == i:
                tri[i * _TRI_STRIDE + c] = _ONE
            elif c > i:
                tri[i * _TRI_STRIDE + c] = _ZERO

    # 5. W = T diag(beta e^gamma) K -> w, U = T diag(beta) V -> out; thread rows ti + side*a, columns
    #    tj + side*b of each staged tile.
    acc_w = cuda.local.array(_TILE_OUTPUTS, float32)
    acc_u = cuda.local.array(_TILE_OUTPUTS, float32)
    t_row = cuda.local.array(TILE_ENTRIES, float32)
    for base in range(0, max(k_dim, v_dim), width):
        cuda.syncthreads()  # T complete / the previous tile consumed
        for e in range(thread, chunk * width, threads):
            m = e // width
            col = e % width
            k_value = _ZERO
            v_value = _ZERO
            if m < length:
                if base < k_dim:
                    k_value = key_scale[m] * mixed[t0 + m, k_column + base + col]
                if base < v_dim:
                    v_value = beta_shared[m] * mixed[t0 + m, v_column + base + col]
            tile_a[m * _TILE_STRIDE + col] = k_value
            tile_b[m * _TILE_STRIDE + col] = v_value
        cuda.syncthreads()
        for e in range(2 * TILE_ENTRIES):
            acc_w[e] = _ZERO
            acc_u[e] = _ZERO
        for m in range(length):
            for a in range(TILE_ENTRIES):
                t_row[a] = tri[(ti + side * a) * _TRI_STRIDE + m]
            k0 = tile_a[m * _TILE_STRIDE + tj]
            k1 = tile_a[m * _TILE_STRIDE + tj + side]
            v0 = tile_b[m * _TILE_STRIDE + tj]
            v1 = tile_b[m * _TILE_STRIDE + tj + side]
            for a in range(TILE_ENTRIES):
                acc_w[2 * a] += t_row[a] * k0
                acc_w[2 * a + 1] += t_row[a] * k1
                acc_u[2 * a] += t_row[a] * v0
                acc_u[2 * a + 1] += t_row[a] * v1
        for a in range(TILE_ENTRIES):
            i = ti + side * a
            if i < length:
                for b in range(2):
                    col = base + tj + side * b
                    if base < k_dim:
                        w[head, t0 + i, col] = acc_w[2 * a + b]
                    if base < v_dim:
                        out[t0 + i, head * v_dim + col] = acc_u[2 * a + b]


@kernel(_RECURRENCE_SIGNATURE, launch_bounds=RECURRENCE_THREADS)
def gdn_chunk_recurrence(mixed, w, qk, decay, out, delta_state, slot, num_k_heads, chunk):
    """Block (value head, 32-column slice of S), threads (column j, row group g): the chunks in order.

    `mixed` [T*conv_dim] and `w` [Hv*T*dk] are flat (16-byte loads); `out` holds U on entry, o on exit.
    """
    column = cuda.threadIdx.x
    group = cuda.threadIdx.y
    groups = cuda.blockDim.y
    head = cuda.blockIdx.x
    value = cuda.blockIdx.y * COLUMN_TILE + column  # this thread's column of S_h
    num_v_heads = delta_state.shape[1]
    k_dim = delta_state.shape[2]
    v_dim = delta_state.shape[3]
    tokens = out.shape[0]
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    key_head = head % num_k_heads
    q_column = key_head * k_dim
    k_column = (num_k_heads + key_head) * k_dim
    out_column = head * v_dim + value
    first_row = group * ROWS_PER_THREAD

    state_shared = cuda.shared.array(_STATE_SLICE, float32)  # S[r, j] at r*32 + j
    delta_shared = cuda.shared.array(_CHUNK_SLICE, float32)  # Delta[i, j]
    qs_shared = cuda.shared.array(_CHUNK_SLICE, float32)  # e^gamma_i (Q S)[i, j]
    acc_w = cuda.local.array(SLAB_ROWS, float32)
    acc_q = cuda.local.array(SLAB_ROWS, float32)
    state = cuda.local.array(ROWS_PER_THREAD, float32)

    head_state = delta_state[slot, head]  # [dk, dv] view
    for m in range(ROWS_PER_THREAD):
        state_shared[(first_row + m) * COLUMN_TILE + column] = head_state[first_row + m, value]
    cuda.syncthreads()

    slab_rows = SLAB_ROWS * groups
    for chunk_index in range((tokens + chunk - 1) // chunk):
        t0 = chunk_index * chunk
        length = min(chunk, tokens - t0)

        # (A) rows i = g (mod groups): Delta = U - W S and e^gamma Q S, contracting over all dk rows of S. Two
        #     passes (W, then Q) keep half as many loads in flight: 128 registers without spills, not 235.
        for slab in range(0, length, slab_rows):
            for a in range(SLAB_ROWS):
                acc_w[a] = _ZERO
                acc_q[a] = _ZERO
            for r in range(0, k_dim, 4):
                s0 = state_shared[r * COLUMN_TILE + column]
                s1 = state_shared[(r + 1) * COLUMN_TILE + column]
                s2 = state_shared[(r + 2) * COLUMN_TILE + column]
                s3 = state_shared[(r + 3) * COLUMN_TILE + column]
                for a in range(SLAB_ROWS):
                    t = t0 + min(slab + group + groups * a, length - 1)  # past the end: a valid row, unused
                    w0, w1, w2, w3 = load_f32x4(w, (head * tokens + t) * k_dim + r)
                    acc_w[a] += w0 * s0 + w1 * s1 + w2 * s2 + w3 * s3
            for r in range(0, k_dim, 4):
                s0 = state_shared[r * COLUMN_TILE + column]
                s1 = state_shared[(r + 1) * COLUMN_TILE + column]
                s2 = state_shared[(r + 2) * COLUMN_TILE + column]
                s3 = state_shared[(r + 3) * COLUMN_TILE + column]
                for a in range(SLAB_ROWS):
                    t = t0 + min(slab + group + groups * a, length - 1)
                    q0, q1, q2, q3 = load_f32x4(mixed, t * conv_dim + q_column + r)
                    acc_q[a] += q0 * s0 + q1 * s1 + q2 * s2 + q3 * s3
            for a in range(SLAB_ROWS):
                i = slab + group + groups * a
                if i < length:
                    t = t0 + i
                    delta_shared[i * COLUMN_TILE + column] = out[t, out_column] - acc_w[a]  # out holds U
                    qs_shared[i * COLUMN_TILE + column] = decay[head, t, 0] * acc_q[a]
        cuda.syncthreads()

        # (B) o_i = e^gamma_i (Q S)_i + sum_{m <= i} (M o Q K^T)_im Delta_m, over U's place in out.
        for i in range(group, length, groups):
            o = qs_shared[i * COLUMN_TILE + column]
            for m in range(i + 1):
                o += qk[head, chunk_index, i, m] * delta_shared[m * COLUMN_TILE + column]
            out[t0 + i, out_column] = o

        # (C) S <- e^gamma_L S + K^T diag(e^(gamma_L - gamma)) Delta, for this thread's 16 rows.
        chunk_decay = decay[head, t0 + length - 1, 0]
        for m in range(ROWS_PER_THREAD):
            state[m] = state_shared[(first_row + m) * COLUMN_TILE + column] * chunk_decay
        for i in range(length):
            t = t0 + i
            d = delta_shared[i * COLUMN_TILE + column] * decay[head, t, 1]
            for r in range(0, ROWS_PER_THREAD, 4):
                k0, k1, k2, k3 = load_f32x4(mixed, t * conv_dim + k_column + first_row + r)
                state[r] += k0 * d
                state[r + 1] += k1 * d
                state[r + 2] += k2 * d
                state[r + 3] += k3 * d
        for m in range(ROWS_PER_THREAD):
            state_shared[(first_row + m) * COLUMN_TILE + column] = state[m]
        cuda.syncthreads()  # S updated; Delta and Q S free for the next chunk

    for m in range(ROWS_PER_THREAD):
        head_state[first_row + m, value] = state_shared[(first_row + m) * COLUMN_TILE + column]


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

    q_shared = cuda.shared.array(_STAGED_KEYS, float32)
    k_shared = cuda.shared.array(_STAGED_KEYS, float32)
    v_shared = cuda.shared.array(_STAGED_VALUES, float32)
    beta_shared = cuda.shared.array(STAGED_TOKENS, float32)
    alpha_shared = cuda.shared.array(STAGED_TOKENS, float32)
    partials = cuda.shared.array(_PARTIALS, float32)  # double-buffered by token parity

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
            read_k = _ZERO
            read_q = _ZERO
            key_query = _ZERO
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
            u = _ZERO
            o = _ZERO
            kq = _ZERO
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
    squares = cuda.shared.array(_NORM_SQUARES, float32)
    inverse_rms = cuda.shared.array(NORM_TOKENS, float32)
    for s in range(NORM_TOKENS):
        o = _ZERO
        if first + s < tokens:
            o = out[first + s, out_column]
        values[s] = o
        squares[s * _ROW_STRIDE + column] = o * o
    cuda.syncthreads()
    if column < NORM_TOKENS:
        total = _ZERO
        for c in range(v_dim):
            total += squares[column * _ROW_STRIDE + c]
        inverse_rms[column] = _ONE / float32(math.sqrt(total / float32(v_dim) + rms_eps))
    cuda.syncthreads()
    for s in range(NORM_TOKENS):
        t = first + s
        if t < tokens:
            out[t, out_column] = values[s] * inverse_rms[s] * norm_weight[column] * silu(projection[t, z_column])


# -- launchers ---------------------------------------------------------------------------------------


def num_chunks(tokens: int, chunk: int) -> int:
    return -(-tokens // chunk)


@dataclass(frozen=True, slots=True)
class ChunkWorkspace:
    """What the chunked path passes from its parallel launch to its sequential one (fp32, device memory)."""

    w: Any
    """[Hv, T, dk]: the WY factor W = T diag(beta e^gamma) K of each chunk."""
    qk: Any
    """[Hv, chunks, C, C]: e^(gamma_i - gamma_j) q_i.k_j for j <= i, else 0."""
    decay: Any
    """[Hv, T, 2]: e^gamma_i (chunk start to token i) and e^(gamma_L - gamma_i) (token i to chunk end)."""

    @staticmethod
    def shapes(shape: GatedDeltaNetShape, tokens: int, chunk: int) -> tuple[tuple[int, ...], ...]:
        heads = shape.num_v_heads
        return (
            (heads, tokens, shape.k_head_dim),
            (heads, num_chunks(tokens, chunk), chunk, chunk),
            (heads, tokens, 2),
        )

    @classmethod
    def nbytes(cls, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK) -> int:
        return sum(4 * math.prod(dims) for dims in cls.shapes(shape, tokens, chunk))

    @classmethod
    def allocate(cls, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK) -> ChunkWorkspace:
        return cls(*(cuda.device_array(dims, np.float32) for dims in cls.shapes(shape, tokens, chunk)))

    @classmethod
    def from_buffer(
        cls, buffer: Any, shape: GatedDeltaNetShape, tokens: int, chunk: int = DEFAULT_CHUNK
    ) -> ChunkWorkspace:
        """Views into one flat fp32 device buffer (allocated once for the longest prompt, shared by all
        layers) of at least `nbytes / 4` elements. Every view starts 16-byte aligned when the buffer does."""
        (length,) = check_array(buffer, "buffer", np.float32, 1)
        views = []
        offset = 0
        for dims in cls.shapes(shape, tokens, chunk):
            size = math.prod(dims)
            if offset + size > length:
                raise ValueError(f"a workspace for {tokens} tokens needs {cls.nbytes(shape, tokens, chunk) // 4} "
                                 f"fp32 elements, the buffer has {length}")  # fmt: skip
            views.append(buffer[offset : offset + size].reshape(dims))
            offset += size
        return cls(*views)


def check_prefill_shape(shape: GatedDeltaNetShape, chunk: int) -> None:
    """Raise ValueError unless the prefill kernels can run this layer with this chunk length."""
    if shape.k_head_dim > MAX_KEY_DIM:
        raise ValueError(f"GDN prefill kernels take key heads up to {MAX_KEY_DIM}, got dk={shape.k_head_dim}")
    if shape.v_head_dim % COLUMN_TILE:
        raise ValueError(f"GDN prefill kernels need dv a multiple of {COLUMN_TILE}, got {shape.v_head_dim}")
    if chunk not in CHUNK_SIZES:
        raise ValueError(f"chunk must be one of {CHUNK_SIZES}, got {chunk}")
    if shape.conv_kernel - 1 > CONV_TOKENS:
        raise ValueError(f"conv kernels wider than {CONV_TOKENS + 1} taps are not supported")


def prefill_launches(
    shape: GatedDeltaNetShape,
    weights: GatedDeltaNetWeights,
    projection: Any,
    conv_state: Any,
    delta_state: Any,
    slot: int,
    out: Any,
    *,
    chunk: int = DEFAULT_CHUNK,
    chunked: bool = True,
    mixed: Any = None,
    workspace: ChunkWorkspace | None = None,
) -> list[Launch]:
    """The launches that run the T = projection.shape[0] tokens of one prompt through one GDN layer.

    projection [T, P] fp32 (layout in `gated_deltanet`'s docstring; not modified), conv_state
    [S, K-1, conv_dim] and delta_state [S, Hv, dk, dv] fp32 (slot `slot` read and updated in place),
    out [T, Hv*dv] fp32. `mixed` [T, conv_dim] receives the conv's output (allocated when None; it must not be
    the projection). The chunked path (`chunked=True`, chunk length `chunk`) also needs a `ChunkWorkspace`
    for T tokens (allocated when None); `chunked=False` runs the recurrence token by token in one launch.
    Allocating here is for convenience: an engine passes preallocated buffers.
    """
    check_prefill_shape(shape, chunk)
    tokens, width = check_array(projection, "projection", np.float32, 2)
    if tokens == 0:
        raise ValueError("a prefill needs at least one token")
    if width != shape.projection_width:
        raise ValueError(f"projection must have {shape.projection_width} columns (qkv | z | b | a), got {width}")
    num_slots = check_array(conv_state, "conv_state", np.float32, 3)[0]
    check_array(conv_state, "conv_state", np.float32, 3, (num_slots, shape.conv_kernel - 1, shape.conv_dim))
    state_shape = (num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim)
    check_array(delta_state, "delta_state", np.float32, 4, state_shape)
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot} out of range 0..{num_slots - 1}")
    check_array(out, "out", np.float32, 2, (tokens, shape.output_width))
    if mixed is None:
        mixed = cuda.device_array((tokens, shape.conv_dim), np.float32)
    elif mixed is projection:
        raise ValueError("mixed must be a buffer of its own: a prompt's conv reads inputs other blocks would overwrite")
    check_array(mixed, "mixed", np.float32, 2, (tokens, shape.conv_dim))
    check_array(weights.conv_weight, "weights.conv_weight", np.float32, 2, (shape.conv_dim, shape.conv_kernel))
    check_array(weights.ssm_a, "weights.ssm_a", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.dt_bias, "weights.dt_bias", np.float32, 1, (shape.num_v_heads,))
    check_array(weights.norm_weight, "weights.norm_weight", np.float32, 1, (shape.v_head_dim,))

    num_k_heads = np.int32(shape.num_k_heads)
    slot32 = np.int32(slot)
    conv = Launch(
        gdn_prefill_conv,
        grid=(2 * shape.num_k_heads + shape.num_v_heads, num_chunks(tokens, CONV_TOKENS)),
        block=(max(shape.k_head_dim, shape.v_head_dim),),
        args=(
            projection,
            weights.conv_weight,
            conv_state,
            mixed,
            slot32,
            num_k_heads,
            np.int32(shape.k_head_dim),
            np.int32(shape.v_head_dim),
            np.float32(shape.k_head_dim**-0.5),  # rounded as the reference rounds it
        ),
    )
    state_grid = (shape.num_v_heads, shape.v_head_dim // COLUMN_TILE)
    state_block = (COLUMN_TILE, shape.k_head_dim // ROWS_PER_THREAD)
    norm = Launch(
        gdn_prefill_gated_norm,
        grid=(shape.num_v_heads, num_chunks(tokens, NORM_TOKENS)),
        block=(shape.v_head_dim,),
        args=(projection, weights.norm_weight, out, np.float32(shape.rms_eps)),
    )
    if not chunked:
        sequential = Launch(
            gdn_prefill_sequential,
            grid=state_grid,
            block=state_block,
            args=(projection, mixed, weights.ssm_a, weights.dt_bias, delta_state, out, slot32, num_k_heads),
        )
        return [conv, sequential, norm]

    if workspace is None:
        workspace = ChunkWorkspace.allocate(shape, tokens, chunk)
    w_shape, qk_shape, decay_shape = ChunkWorkspace.shapes(shape, tokens, chunk)
    check_array(workspace.w, "workspace.w", np.float32, 3, w_shape)
    check_array(workspace.qk, "workspace.qk", np.float32, 4, qk_shape)
    check_array(workspace.decay, "workspace.decay", np.float32, 3, decay_shape)
    chunk32 = np.int32(chunk)
    prepare = Launch(
        gdn_chunk_prepare,
        grid=(num_chunks(tokens, chunk), shape.num_v_heads),
        block=((chunk // TILE_ENTRIES) ** 2,),
        args=(
            projection,
            mixed,
            weights.ssm_a,
            weights.dt_bias,
            workspace.w,
            workspace.qk,
            workspace.decay,
            out,
            num_k_heads,
            chunk32,
        ),
    )
    recurrence = Launch(
        gdn_chunk_recurrence,
        grid=state_grid,
        block=state_block,
        args=(
            mixed.reshape(-1),
            workspace.w.reshape(-1),
            workspace.qk,
            workspace.decay,
            out,
            delta_state,
            slot32,
            num_k_heads,
            chunk32,
        ),
    )
    return [conv, prepare, recurrence, norm]


# -- benchmark (GPU only) ----------------------------------------------------------------------------


def benchmark_prefill(
    shape: GatedDeltaNetShape,
    tokens: int,
    *,
    chunk: int = DEFAULT_CHUNK,
    replays: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """GPU time of one layer's prefill of `tokens` tokens, chunked and token by token, in µs.

    Each variant's launches are replayed from a CUDA graph (`cmpchat.cuda.profile.profile_launches`: no
    launch overhead in the figures): `<variant>_us` is a whole replay, `<kernel>_us` each kernel's share.
    `speedup` is token by token over chunked for the whole layer, `recurrence_speedup` the same for the
    recurrence alone (prepare + chunk recurrence against the token loop). `decode_prompt_us` times the decode
    kernels' prompt mode (`decode_step(..., tokens_per_sequence=T)`, what the backend's prompt chunks run).
    """
    from cmpchat.cuda.profile import profile_launches

    rng = np.random.default_rng(seed)
    f32 = np.float32
    weights = GatedDeltaNetWeights(
        cuda.to_device((0.3 * rng.standard_normal((shape.conv_dim, shape.conv_kernel))).astype(f32)),
        cuda.to_device(-np.exp(rng.standard_normal(shape.num_v_heads)).astype(f32)),
        cuda.to_device(rng.standard_normal(shape.num_v_heads).astype(f32)),
        cuda.to_device((1.0 + 0.1 * rng.standard_normal(shape.v_head_dim)).astype(f32)),
    )
    projection = cuda.to_device(rng.standard_normal((tokens, shape.projection_width)).astype(f32))
    conv_state = cuda.to_device(np.zeros((1, shape.conv_kernel - 1, shape.conv_dim), f32))
    delta_state = cuda.to_device(np.zeros((1, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim), f32))
    out = cuda.device_array((tokens, shape.output_width), f32)
    mixed = cuda.device_array((tokens, shape.conv_dim), f32)
    workspace = ChunkWorkspace.allocate(shape, tokens, chunk)
    arguments = (shape, weights, projection, conv_state, delta_state, 0, out)
    variants = {
        "chunked": prefill_launches(*arguments, chunk=chunk, mixed=mixed, workspace=workspace),
        "sequential": prefill_launches(*arguments, chunked=False, mixed=mixed),
    }
    slots = cuda.to_device(np.zeros(tokens, np.int32))
    variants["decode_prompt"] = list(decode_step(*arguments[:5], slots, out, mixed, tokens_per_sequence=tokens))

    stream = cuda.stream()
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk}
    for name, launches in variants.items():
        for launch in launches:  # compile and warm up
            launch.run(stream)
        stream.synchronize()
        timings = profile_launches(launches, stream, replays=replays)
        result[f"{name}_us"] = 1e6 * timings.replay
        for kernel_name, seconds in zip(timings.names, timings.attributed(), strict=True):
            result[f"{kernel_name}_us"] = 1e6 * seconds
    result["chunked_recurrence_us"] = result["gdn_chunk_prepare_us"] + result["gdn_chunk_recurrence_us"]
    result["sequential_recurrence_us"] = result["gdn_prefill_sequential_us"]
    result["speedup"] = result["sequential_us"] / result["chunked_us"]
    result["recurrence_speedup"] = result["sequential_recurrence_us"] / result["chunked_recurrence_us"]
    return result


def main(argv: list[str] | None = None) -> int:
    from cmpchat.model.builder import MODEL_SHAPES

    parser = argparse.ArgumentParser(
        prog="python -m cmpchat.cuda.kernels.gated_deltanet_chunked",
        description="Time one GDN layer's prefill on the GPU: chunked (WY) against token by token.",
    )
    parser.add_argument("models", nargs="+", choices=sorted(MODEL_SHAPES), help="model shapes, e.g. 9B 27B")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1160, 4620, 16384])
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, choices=CHUNK_SIZES)
    parser.add_argument("--replays", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"{'model':>6} {'tokens':>7} {'chunked us':>11} {'token us':>10} {'ratio':>6}   "
        f"{'prepare':>9} {'chunk rec':>9} {'token rec':>9} {'rec ratio':>9} {'conv':>8} {'norm':>8} {'decode':>10}"
    )
    for name in args.models:
        model = MODEL_SHAPES[name]
        shape = GatedDeltaNetShape(
            model.num_k_heads, model.num_v_heads, model.k_head_dim, model.v_head_dim, model.conv_kernel, model.rms_eps
        )
        for tokens in args.tokens:
            r = benchmark_prefill(shape, tokens, chunk=args.chunk, replays=args.replays)
            print(
                f"{name:>6} {tokens:>7} {r['chunked_us']:>11.1f} {r['sequential_us']:>10.1f} {r['speedup']:>6.2f}   "
                f"{r['gdn_chunk_prepare_us']:>9.1f} {r['gdn_chunk_recurrence_us']:>9.1f} "
                f"{r['sequential_recurrence_us']:>9.1f} {r['recurrence_speedup']:>9.2f} "
                f"{r['gdn_prefill_conv_us']:>8.1f} {r['gdn_prefill_gated_norm_us']:>8.1f} "
                f"{r['decode_prompt_us']:>10.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
