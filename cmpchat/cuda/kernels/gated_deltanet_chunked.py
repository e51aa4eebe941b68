"""Gated DeltaNet prefill: the T tokens of one prompt through one GDN layer, chunked (WY / UT transform) or
token by token, in fp32 on CUDA cores (QWEN35.md "Gated DeltaNet"; the algorithm and its numerical safety are
in `cmpchat.backends.reference.gated_deltanet_chunked`, its numpy reference).

Buffers are the decode step's (`gated_deltanet`): `projection [T, P]` (qkv | z | b | a per token),
`conv_state [S, K-1, conv_dim]` and `delta_state [S, Hv, dk, dv]` fp32 (slot `slot` is read and updated in
place), `out [T, Hv*dv]` = RMSNorm(o_h) * ssm_norm.weight * silu(z_h). Plus `mixed [T, conv_dim]` (the conv's
output; unlike decode it cannot overwrite the projection, as the conv of token t reads the raw inputs of
t-K+1..t, which other blocks would be overwriting) and, for the chunked path, a `ChunkWorkspace`.

Launches, chunked (`prefill_launches(..., chunked=True)`), as flash-linear-attention's chunk_gated_delta_rule:
only launch 3 is sequential over the chunks, and it does only the two products that need the running state.
1. `gdn_prefill_conv`, grid (2Hk+Hv heads, ceil(T/16)), one thread per channel, 16 tokens per block: causal
   depthwise conv (K = 4: a sliding window in registers, one load per token), SiLU, q/k L2 norm and q scaling
   as `gdn_conv_step`; outputs stay in registers until the norms are known, so each is written once (per-token
   sums of squares by 8 threads, then 1). The first tile's blocks then write the new conv state.
2. `gdn_chunk_prepare`, grid (chunks, Hv), (C/4)^2 threads (256 for C = 64), fully parallel: gates and the
   compensated cumulative log decays -> workspace.decay; K K^T and Q K^T in 4x4 register tiles over 32 key
   dims staged at a time (12 LDS.128 per 128 FMAs); A; T = (I + A)^-1 by blocked forward substitution, a 4x4
   block of T per thread in registers, C/4 steps of one barrier each (a block row of T finished and published,
   then subtracted from the later rows by all their threads at once; one thread per column solving it alone
   left 6 of 8 warps waiting at the next barrier for half the kernel); W = T diag(beta e^gamma) K ->
   workspace.w and U = T diag(beta) V -> `out`, C columns of [K | V] staged at a time (8 LDS.128 per 64 FMAs,
   stopping at T's diagonal); masked decayed Q K^T -> workspace.qk.
3. `gdn_chunk_state`, grid (Hv, dv/16) (256 blocks for 9B), max(2C, dk) = 128 threads: the state slice
   S [dk x 16] in registers (4x4 per thread) and in shared memory. Per chunk: S -> workspace.states[c];
   Delta = U - W S (4x4 tiles, dk split in two halves summed through shared memory) over U in `out`;
   S <- e^gamma_L S + K^T diag(e^(gamma_L - gamma)) Delta. W and K of the chunk are staged in one shared tile in
   turn, the next one's 16-byte loads in flight in registers while the current one is used; four barriers.
   The update S += K^T D takes four tokens a step (the tiles' rows past the chunk's length are zeros).
4. `gdn_chunk_output`, grid (dv/32, Hv, chunks), 2C threads, fully parallel: o = e^gamma Q S_c +
   (M o Q K^T) Delta in 4x4 register tiles (8 LDS.128 per 64 FMAs), over Delta in `out` (each block stages
   its Delta before writing o in its place; no other block reads it). Tiles are staged STAGE_BATCH 16-byte
   loads per thread at a time, all issued before any is stored.
5. `gdn_prefill_gated_norm`, grid (Hv, ceil(T/16)), dv threads, 16 tokens per block:
   out = RMSNorm(o) * weight * silu(z), in place.

Token by token (`chunked=False`): launches 1 and 5 with `gdn_prefill_sequential` in between: grid (Hv, dv/32),
block (32, dk/16), the state slice in registers (16 per thread) for all T tokens, q/k of 16 tokens staged
at a time, one barrier per token (u = S'^T k, S'^T q and k.q reduced together; o = S'^T q + (k.q) delta).

Numba emits no vector shared-memory access, so the register tiles use the 16-byte `load_shared_f32x4`,
`store_shared_f32x4` and `store_f32x4` of `cmpchat.cuda.intrinsics` (shared arrays declared 16-byte aligned).
Static shared memory (sm_70 allows 48 KB): prepare 36 KB, state 45 KB, output 26 KB, sequential 24.1 KB, conv and norm
16.6 KB; all for dk <= 128 (a power of two), C <= 64. ptxas for sm_70 (CUDA 12.9), registers per thread: conv 64,
prepare 128, state 255 (8 bytes spilled; none on sm_90), output 108, sequential 94, norm 60. No tensor-core
instruction (DESIGN.md). Staging loops split indices with shifts and masks, never a division by a runtime
width (~20 instructions each: they were most of the state pass's instructions), and the chunked kernels' block-
strided loops are while loops: Numba's range() with a runtime step works out its trip count with a 64-bit
division and sign tests at every entry (prepare 4472 -> 2896 SASS instructions, output 2408 -> 1232).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32

from cmpchat.cuda.compile import kernel
from cmpchat.cuda.intrinsics import (
    SIMULATOR,
    load_f32x4,
    load_global_f32x4,
    load_shared_f32x4,
    store_f32x4,
    store_shared_f32x4,
)
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
"""Chunk lengths the kernels take: (C/4)^2 prepare threads build a chunk's C x C matrices in 4x4 register tiles."""
MAX_CHUNK = 64
MAX_KEY_DIM = 128
"""The shared-memory budget (48 KB static on sm_70) is laid out for dk <= 128 (all released sizes)."""
COLUMN_TILE = 32
"""State columns per block of the token-by-token kernel (one warp-wide row of threads); dv must be a multiple."""
MAX_GROUPS = MAX_KEY_DIM // ROWS_PER_THREAD
STATE_COLUMNS = 16
"""Columns of S per block of the state pass: Hv * dv / 16 blocks (256 for 9B) of STATE_THREADS."""
STATE_THREADS = 128
OUTPUT_COLUMNS = 32
"""Value columns per block of the output kernel."""
OUTPUT_THREADS = 128
STAGE_BATCH = 4
"""16-byte loads an output-kernel thread has in flight while staging a tile (8 take 146 registers on sm_70)."""
PREFETCH = 16
"""16-byte loads per state-pass thread holding the next 64 x dk tile (W or K) while the current one is used."""
CONV_TOKENS = 16
NORM_TOKENS = 16
REDUCE_PARTS = 8
"""Per-token sums of squares (conv L2 norm, gated RMSNorm) are summed by 8 threads per token, then by one."""
STAGED_TOKENS = 16
"""Tokens whose q/k the token-by-token kernel stages in shared memory per barrier pair."""
RECURRENCE_THREADS = COLUMN_TILE * MAX_GROUPS
TILE_ENTRIES = 4
"""Each prepare thread owns a 4x4 tile of the chunk's C x C matrices (rows ti + C/4 * a, cols tj + C/4 * b)."""
GRAM_COLUMNS = 32
"""Key dims staged at a time for the prepare's Gram matrices."""

_ALIGN = None if SIMULATOR else 16  # 16-byte shared arrays for the vector loads (the simulator takes no alignment)
_ROW_STRIDE = MAX_HEAD_DIM + 1  # per-token rows of squares
_GRAM_STRIDE = GRAM_COLUMNS + 4  # padded rows, multiples of 4 (16-byte rows) and 4 banks apart
_WIDE_STRIDE = MAX_CHUNK + 4
_TILE_STRIDE_MAX = MAX_KEY_DIM + 4
_ZERO = float32(0.0)
_ONE = float32(1.0)
# Array sizes as plain constants (Numba types a shared/local array's size only from a literal or a global).
_CONV_SQUARES = CONV_TOKENS * _ROW_STRIDE
_NORM_SQUARES = NORM_TOKENS * _ROW_STRIDE
_CONV_PARTIALS = CONV_TOKENS * REDUCE_PARTS
_NORM_PARTIALS = NORM_TOKENS * REDUCE_PARTS
_GRAM_STAGE = 2 * MAX_CHUNK * _GRAM_STRIDE  # K and Q; later A (64 x 65) and the W/U stage (64 x 68)
_WIDE_SIZE = MAX_CHUNK * _WIDE_STRIDE
_TILE_ENTRIES_2D = TILE_ENTRIES * TILE_ENTRIES
_STATE_TILE = MAX_CHUNK * _TILE_STRIDE_MAX
_STATE_SLICE = MAX_KEY_DIM * STATE_COLUMNS
_DELTA_SLICE = MAX_CHUNK * STATE_COLUMNS
_PREFETCH_VALUES = 4 * PREFETCH
_OUTPUT_Q = MAX_CHUNK * _WIDE_STRIDE
_OUTPUT_S = MAX_CHUNK * (OUTPUT_COLUMNS + 4)
_OUTPUT_STRIDE = OUTPUT_COLUMNS + 4
_OUTPUT_QUADS_LOG2 = (OUTPUT_COLUMNS // 4).bit_length() - 1
_STAGE_VALUES = 4 * STAGE_BATCH
_STAGED_KEYS = STAGED_TOKENS * MAX_KEY_DIM
_STAGED_VALUES = STAGED_TOKENS * COLUMN_TILE
_PARTIALS = 2 * 3 * MAX_GROUPS * COLUMN_TILE  # u, S'^T q and k.q per row group, double-buffered

_CONV_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, ::1], int32, int32, int32, int32, float32)"
)
_PREPARE_SIGNATURE = (
    "void(float32[:, ::1], float32[::1], float32[::1], float32[::1], float32[::1], "
    "float32[:, :, :, ::1], float32[:, :, ::1], float32[::1], int32, int32)"
)
_STATE_SIGNATURE = (
    "void(float32[::1], float32[::1], float32[:, :, ::1], float32[::1], float32[::1], "
    "float32[:, :, :, ::1], int32, int32, int32)"
)
_OUTPUT_SIGNATURE = (
    "void(float32[::1], float32[::1], float32[:, :, ::1], float32[::1], float32[::1], int32, int32, int32, int32)"
)
_SEQUENTIAL_SIGNATURE = (
    "void(float32[:, ::1], float32[:, ::1], float32[::1], float32[::1], float32[:, :, :, ::1], "
    "float32[:, ::1], int32, int32)"
)
_NORM_SIGNATURE = "void(float32[:, ::1], float32[::1], float32[:, ::1], float32)"


@cuda.jit(device=True, inline=True)
def _log2(n):
    """log2 of a power of two: staging loops split an index into row and quad with a shift and a mask, where a
    division by a runtime width costs ~20 instructions (check_prefill_shape keeps dk and C powers of two)."""
    result = 0
    while (1 << result) < n:
        result += 1
    return result


@cuda.jit(device=True, inline=True)
def _sum_squares(squares, partials, norms, width, lane, lanes):
    """partials[s*8 + p] = sum of squares[s][c] for c = p (mod 8); then norms[s] = the sum over p. Two barriers;
    every thread of the block calls it."""
    for e in range(lane, CONV_TOKENS * REDUCE_PARTS, lanes):
        s = e // REDUCE_PARTS
        total = _ZERO
        for c in range(e % REDUCE_PARTS, width, REDUCE_PARTS):
            total += squares[s * _ROW_STRIDE + c]
        partials[e] = total
    cuda.syncthreads()
    if lane < CONV_TOKENS:
        total = _ZERO
        for p in range(REDUCE_PARTS):
            total += partials[lane * REDUCE_PARTS + p]
        norms[lane] = total
    cuda.syncthreads()


# -- kernels -----------------------------------------------------------------------------------------


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
    squares = cuda.shared.array(_CONV_SQUARES, float32)
    partials = cuda.shared.array(_CONV_PARTIALS, float32)
    norms = cuda.shared.array(CONV_TOKENS, float32)
    values = cuda.local.array(CONV_TOKENS, float32)
    active = lane < width
    if active and taps == 4:  # the released width: a sliding window in registers, one load per token
        w0 = conv_weight[channel, 0]
        w1 = conv_weight[channel, 1]
        w2 = conv_weight[channel, 2]
        w3 = conv_weight[channel, 3]
        x0 = _ZERO
        x1 = _ZERO
        x2 = _ZERO
        for m in range(3):  # inputs first-3 .. first-1: before the prompt, the carried raw inputs
            source = first - 3 + m
            x = _ZERO
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
            x3 = _ZERO
            if t < tokens:
                x3 = projection[t, channel]
            values[s] = silu(x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3)  # the reference's tap order
            x0 = x1
            x1 = x2
            x2 = x3
    elif active:
        for s in range(CONV_TOKENS):
            t = first + s
            total = _ZERO
            for tap in range(taps):  # tap 0 is the oldest input, tap K-1 the current one
                source = t - history + tap
                x = _ZERO
                if source >= 0:
                    if source < tokens:
                        x = projection[source, channel]
                else:  # before the prompt: the carried raw inputs (only the first tile gets here)
                    x = conv_state[slot, history + source, channel]
                total += x * conv_weight[channel, tap]
            values[s] = silu(total)
    if head < qk_heads:  # uniform over the block: L2 norm of each token's head, then q's scale
        for s in range(CONV_TOKENS):
            value = _ZERO
            if active and first + s < tokens:
                value = values[s]
            squares[s * _ROW_STRIDE + lane] = value * value
        cuda.syncthreads()
        _sum_squares(squares, partials, norms, width, lane, lanes)
        scale = _ONE
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
    stage = cuda.shared.array(_GRAM_STAGE, float32, alignment=_ALIGN)  # K | Q, then A, then [K' | V'] tiles
    tmat = cuda.shared.array(_WIDE_SIZE, float32, alignment=_ALIGN)  # T = (I + A)^-1, row-major, stride C+4

    # 1. Gates, and gamma_i = g_1 + ... + g_i as compensated sums (hi + lo): see the reference's docstring.
    i = thread
    while i < length:
        t = t0 + i
        beta_shared[i] = sigmoid(projection[t, b_column])
        log_hi[i] = ssm_a[head] * softplus(projection[t, a_column] + dt_bias[head])  # g <= 0
        i += threads
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
    i = thread
    while i < length:
        decay_in = float32(math.exp(log_hi[i] + log_lo[i]))  # every exponent here is <= 0
        decay[head, t0 + i, 0] = decay_in
        decay[head, t0 + i, 1] = float32(math.exp((last_hi - log_hi[i]) + (last_lo - log_lo[i])))
        key_scale[i] = beta_shared[i] * decay_in
        i += threads

    # 2. Gram matrices K K^T and Q K^T, thread tile rows ti + side*a, columns tj + side*b, over 32 key dims
    #    staged at a time: per 4 dims 12 LDS.128 (K and Q rows, nearly broadcast; K columns) for 128 FMAs.
    kk = cuda.local.array(_TILE_ENTRIES_2D, float32)
    qk_acc = cuda.local.array(_TILE_ENTRIES_2D, float32)
    row_k = cuda.local.array(_TILE_ENTRIES_2D, float32)
    row_q = cuda.local.array(_TILE_ENTRIES_2D, float32)
    col_k = cuda.local.array(_TILE_ENTRIES_2D, float32)
    for e in range(_TILE_ENTRIES_2D):
        kk[e] = _ZERO
        qk_acc[e] = _ZERO
    quads = GRAM_COLUMNS // 4
    q_base = MAX_CHUNK * _GRAM_STRIDE
    for base in range(0, k_dim, GRAM_COLUMNS):
        cuda.syncthreads()  # the previous tile is consumed
        e = thread
        while e < chunk * quads:
            i = e // quads
            col = 4 * (e % quads)
            k0 = k1 = k2 = k3 = q0 = q1 = q2 = q3 = _ZERO
            if i < length:
                row = (t0 + i) * conv_dim + base + col
                k0, k1, k2, k3 = load_f32x4(mixed, row + k_column)
                q0, q1, q2, q3 = load_f32x4(mixed, row + q_column)
            store_shared_f32x4(stage, i * _GRAM_STRIDE + col, k0, k1, k2, k3)
            store_shared_f32x4(stage, q_base + i * _GRAM_STRIDE + col, q0, q1, q2, q3)
            e += threads
        cuda.syncthreads()
        for col in range(0, GRAM_COLUMNS, 4):
            for a in range(TILE_ENTRIES):
                r = (ti + side * a) * _GRAM_STRIDE + col
                row_k[4 * a], row_k[4 * a + 1], row_k[4 * a + 2], row_k[4 * a + 3] = load_shared_f32x4(stage, r)
                row_q[4 * a], row_q[4 * a + 1], row_q[4 * a + 2], row_q[4 * a + 3] = load_shared_f32x4(
                    stage, q_base + r
                )
                c = (tj + side * a) * _GRAM_STRIDE + col
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
            factor = _ZERO
            if j <= i and i < length:
                factor = float32(math.exp((log_hi[i] - log_hi[j]) + (log_lo[i] - log_lo[j])))
            qk[head, chunk_index, i, j] = factor * qk_acc[a * TILE_ENTRIES + b]
            a_ij = _ZERO
            if j < i:
                a_ij = beta_shared[i] * factor * kk[a * TILE_ENTRIES + b]
            stage[i * _WIDE_STRIDE + j] = a_ij

    # 4. T = (I + A)^-1 by blocked forward substitution: thread (ti, tj) holds T's 4x4 block at rows 4ti..4ti+3,
    #    columns 4tj..4tj+3 in registers. In step k the threads of block row k, every earlier block row already
    #    subtracted, finish their diagonal block and publish their rows to tmat; after the step's one barrier
    #    each later block row subtracts A[its rows, 4k..4k+3] T[4k..4k+3, its columns] (4 + 4 LDS.128, 64 FMAs).
    #    A is strictly lower triangular, so rows and columns past the chunk's length stay zero.
    block = cuda.local.array(_TILE_ENTRIES_2D, float32)
    a_block = cuda.local.array(_TILE_ENTRIES_2D, float32)
    t_block = cuda.local.array(_TILE_ENTRIES_2D, float32)
    for r in range(TILE_ENTRIES):
        for c in range(TILE_ENTRIES):
            i = TILE_ENTRIES * ti + r
            block[TILE_ENTRIES * r + c] = _ONE if i == TILE_ENTRIES * tj + c and i < length else _ZERO
    cuda.syncthreads()  # A complete
    for k in range(side):
        if ti == k:
            for r in range(1, TILE_ENTRIES):
                for s in range(r):
                    a_rs = stage[(TILE_ENTRIES * k + r) * _WIDE_STRIDE + TILE_ENTRIES * k + s]
                    for c in range(TILE_ENTRIES):
                        block[TILE_ENTRIES * r + c] -= a_rs * block[TILE_ENTRIES * s + c]
            for r in range(TILE_ENTRIES):
                store_shared_f32x4(tmat, (TILE_ENTRIES * k + r) * _WIDE_STRIDE + TILE_ENTRIES * tj,
                                   block[4 * r], block[4 * r + 1], block[4 * r + 2], block[4 * r + 3])  # fmt: skip
        cuda.syncthreads()  # block row k of T published
        if ti > k:
            for r in range(TILE_ENTRIES):
                index = (TILE_ENTRIES * ti + r) * _WIDE_STRIDE + TILE_ENTRIES * k
                a_block[4 * r], a_block[4 * r + 1], a_block[4 * r + 2], a_block[4 * r + 3] = load_shared_f32x4(
                    stage, index
                )
                index = (TILE_ENTRIES * k + r) * _WIDE_STRIDE + TILE_ENTRIES * tj
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
    acc = cuda.local.array(_TILE_ENTRIES_2D, float32)
    t_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
    s_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
    quads_log2 = _log2(chunk // 4)
    m_end = min(length, ti + side * (TILE_ENTRIES - 1) + 1)
    m_end = (m_end + 3) // 4 * 4
    base = 0
    while base < k_dim + v_dim:
        cuda.syncthreads()  # T complete / A or the previous tile consumed
        e = thread
        while e < chunk << quads_log2:
            m = e >> quads_log2
            g = base + 4 * (e & ((1 << quads_log2) - 1))  # column of [K | V]
            x0 = x1 = x2 = x3 = _ZERO
            if m < length:
                row = (t0 + m) * conv_dim
                if g < k_dim:
                    x0, x1, x2, x3 = load_f32x4(mixed, row + k_column + g)
                    scale = key_scale[m]
                elif g < k_dim + v_dim:
                    x0, x1, x2, x3 = load_f32x4(mixed, row + v_column + g - k_dim)
                    scale = beta_shared[m]
                else:
                    scale = _ZERO
                x0 *= scale
                x1 *= scale
                x2 *= scale
                x3 *= scale
            store_shared_f32x4(stage, m * _WIDE_STRIDE + g - base, x0, x1, x2, x3)
            e += threads
        cuda.syncthreads()
        for e in range(_TILE_ENTRIES_2D):
            acc[e] = _ZERO
        for m in range(0, m_end, 4):
            for a in range(TILE_ENTRIES):
                r = (ti + side * a) * _WIDE_STRIDE + m
                t_rows[4 * a], t_rows[4 * a + 1], t_rows[4 * a + 2], t_rows[4 * a + 3] = load_shared_f32x4(tmat, r)
                r = (m + a) * _WIDE_STRIDE + 4 * tj
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


@cuda.jit(device=True, inline=True)
def _fetch_tile(values, source, first, row_stride, rows, quads_log2, thread, threads):
    """values <- a [rows x 4*2^quads_log2] tile at source[first + row*row_stride + ...] (zero past `rows`, up to the
    chunk's length), 16 bytes per load, each warp reading whole rows. `threads` is a multiple of the row's quads,
    so a thread keeps its quad and steps down the rows: one address increment per load."""
    rows_per_pass = threads >> quads_log2
    row = thread >> quads_log2
    index = first + row * row_stride + 4 * (thread & ((1 << quads_log2) - 1))
    for n in range(PREFETCH):
        x0 = x1 = x2 = x3 = _ZERO
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
    quads_log2 = _log2(k_dim // 4)
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

    tile = cuda.shared.array(_STATE_TILE, float32, alignment=_ALIGN)  # W of the chunk, then its K
    s_shared = cuda.shared.array(_STATE_SLICE, float32, alignment=_ALIGN)  # S [dk][16]
    d_shared = cuda.shared.array(_DELTA_SLICE, float32, alignment=_ALIGN)  # partial Delta, then scaled Delta
    fetched = cuda.local.array(_PREFETCH_VALUES, float32)
    state = cuda.local.array(_TILE_ENTRIES_2D, float32)
    acc = cuda.local.array(_TILE_ENTRIES_2D, float32)
    u = cuda.local.array(_TILE_ENTRIES_2D, float32)
    w_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
    s_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
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
                decay_out[a] = _ZERO
                for b in range(4):
                    u[4 * a + b] = _ZERO
                if i < length:
                    decay_out[a] = decay[head, t0 + i, 1]
                    index = (t0 + i) * out_width + head * v_dim + col0 + 4 * cq
                    for b in range(4):
                        u[4 * a + b] = out[index + b]

        # Phase 1: this half's share of W S for a 4x4 tile of Delta: per 4 key dims 8 LDS.128 for 64 FMAs.
        for e in range(_TILE_ENTRIES_2D):
            acc[e] = _ZERO
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
            for e in range(_TILE_ENTRIES_2D):
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


@cuda.jit(device=True, inline=True)
def _stage_tile(tile, stride, source, first, row_stride, rows, valid_rows, quads_log2, coherent, thread, threads):
    """tile[row * stride + ...] <- source[first + row * row_stride + ...]: a [rows x 4*2^quads_log2] tile into
    shared memory, zeros from row `valid_rows` (>= 1) on. A thread issues STAGE_BATCH 16-byte loads before it
    stores any, so staging waits one memory latency per batch, not one per load; `coherent` loads data this
    kernel overwrites later. Threads keep their quad and step down the rows (`threads` a multiple of the quads)."""
    rows_per_pass = threads >> quads_log2
    quad = 4 * (thread & ((1 << quads_log2) - 1))
    values = cuda.local.array(_STAGE_VALUES, float32)
    first_row = thread >> quads_log2
    while first_row < rows:
        row = first_row
        for n in range(STAGE_BATCH):
            x0 = x1 = x2 = x3 = _ZERO
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

    q_stage = cuda.shared.array(_OUTPUT_Q, float32, alignment=_ALIGN)  # Q [C][64 + 4], then M o Q K^T
    s_stage = cuda.shared.array(_OUTPUT_S, float32, alignment=_ALIGN)  # S_c [64][32 + 4], then Delta
    acc = cuda.local.array(_TILE_ENTRIES_2D, float32)
    a_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
    b_rows = cuda.local.array(_TILE_ENTRIES_2D, float32)
    for e in range(_TILE_ENTRIES_2D):
        acc[e] = _ZERO
    state_first = (chunk_index * num_v_heads + head) * k_dim

    # Q S_c, 64 key dims staged at a time: per 4 dims 8 LDS.128 for 64 FMAs.
    for base in range(0, k_dim, MAX_CHUNK):
        width = min(MAX_CHUNK, k_dim - base)
        quads_log2 = _log2(width // 4)
        cuda.syncthreads()
        _stage_tile(q_stage, _WIDE_STRIDE, mixed, t0 * conv_dim + q_column + base, conv_dim, chunk, length,
                    quads_log2, False, thread, threads)  # fmt: skip
        _stage_tile(s_stage, _OUTPUT_STRIDE, states, (state_first + base) * v_dim + col0, v_dim, width, width,
                    _OUTPUT_QUADS_LOG2, False, thread, threads)  # fmt: skip
        cuda.syncthreads()
        for c in range(0, width, 4):
            for a in range(TILE_ENTRIES):
                r = (rg + side * a) * _WIDE_STRIDE + c
                a_rows[4 * a], a_rows[4 * a + 1], a_rows[4 * a + 2], a_rows[4 * a + 3] = load_shared_f32x4(q_stage, r)
                r = (c + a) * _OUTPUT_STRIDE + 4 * cq
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
    quads_log2 = _log2(chunk // 4)
    qk_first = (head * ((tokens + chunk - 1) // chunk) + chunk_index) * chunk * chunk
    _stage_tile(q_stage, _WIDE_STRIDE, qk, qk_first, chunk, chunk, chunk, quads_log2, False, thread, threads)
    _stage_tile(s_stage, _OUTPUT_STRIDE, out, t0 * out_width + head * v_dim + col0, out_width, chunk, length,
                _OUTPUT_QUADS_LOG2, True, thread, threads)  # fmt: skip
    cuda.syncthreads()
    m_end = min(length, rg + side * (TILE_ENTRIES - 1) + 1)  # M o Q K^T is lower triangular
    m_end = (m_end + 3) // 4 * 4
    for m in range(0, m_end, 4):
        for a in range(TILE_ENTRIES):
            r = (rg + side * a) * _WIDE_STRIDE + m
            a_rows[4 * a], a_rows[4 * a + 1], a_rows[4 * a + 2], a_rows[4 * a + 3] = load_shared_f32x4(q_stage, r)
            r = (m + a) * _OUTPUT_STRIDE + 4 * cq
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
    gates = cuda.local.array(NORM_TOKENS, float32)
    squares = cuda.shared.array(_NORM_SQUARES, float32)
    partials = cuda.shared.array(_NORM_PARTIALS, float32)
    sums = cuda.shared.array(NORM_TOKENS, float32)
    for s in range(NORM_TOKENS):  # o and z of all 16 tokens in flight before the barriers
        o = _ZERO
        z = _ZERO
        if first + s < tokens:
            o = out[first + s, out_column]
            z = projection[first + s, z_column]
        values[s] = o
        gates[s] = z
        squares[s * _ROW_STRIDE + column] = o * o
    cuda.syncthreads()
    _sum_squares(squares, partials, sums, v_dim, column, v_dim)
    weight = norm_weight[column]
    for s in range(NORM_TOKENS):
        t = first + s
        if t < tokens:
            inverse_rms = _ONE / float32(math.sqrt(sums[s] / float32(v_dim) + rms_eps))
            out[t, out_column] = values[s] * inverse_rms * weight * silu(gates[s])


# -- launchers ---------------------------------------------------------------------------------------


def num_chunks(tokens: int, chunk: int) -> int:
    return -(-tokens // chunk)


@dataclass(frozen=True, slots=True)
class ChunkWorkspace:
    """What the chunked path passes between its launches (fp32, device memory)."""

    w: Any
    """[Hv, T, dk]: the WY factor W = T diag(beta e^gamma) K of each chunk."""
    qk: Any
    """[Hv, chunks, C, C]: e^(gamma_i - gamma_j) q_i.k_j for j <= i, else 0."""
    states: Any
    """[chunks, Hv, dk, dv]: the state at each chunk's start (the state pass writes, the output kernel reads)."""
    decay: Any
    """[Hv, T, 2]: e^gamma_i (chunk start to token i) and e^(gamma_L - gamma_i) (token i to chunk end)."""

    @staticmethod
    def shapes(shape: GatedDeltaNetShape, tokens: int, chunk: int) -> tuple[tuple[int, ...], ...]:
        heads = shape.num_v_heads
        chunks = num_chunks(tokens, chunk)
        return (
            (heads, tokens, shape.k_head_dim),
            (heads, chunks, chunk, chunk),
            (chunks, heads, shape.k_head_dim, shape.v_head_dim),
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
        layers) of at least `nbytes / 4` elements. Every view starts 16-byte aligned when the buffer does (the
        kernels' 16-byte accesses need that of w, qk and states: their sizes are multiples of 4 elements)."""
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
    if shape.v_head_dim % COLUMN_TILE or shape.k_head_dim % ROWS_PER_THREAD:
        raise ValueError(f"GDN prefill kernels need dv a multiple of {COLUMN_TILE} and dk of {ROWS_PER_THREAD}, "
                         f"got dv={shape.v_head_dim}, dk={shape.k_head_dim}")  # fmt: skip
    if shape.k_head_dim & (shape.k_head_dim - 1):
        raise ValueError(f"GDN prefill kernels need dk a power of two, got dk={shape.k_head_dim}")
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
    w_shape, qk_shape, states_shape, decay_shape = ChunkWorkspace.shapes(shape, tokens, chunk)
    check_array(workspace.w, "workspace.w", np.float32, 3, w_shape)
    check_array(workspace.qk, "workspace.qk", np.float32, 4, qk_shape)
    check_array(workspace.states, "workspace.states", np.float32, 4, states_shape)
    check_array(workspace.decay, "workspace.decay", np.float32, 3, decay_shape)
    chunk32 = np.int32(chunk)
    chunks = num_chunks(tokens, chunk)
    flat_mixed, flat_w, flat_out = mixed.reshape(-1), workspace.w.reshape(-1), out.reshape(-1)
    flat_states = workspace.states.reshape(-1)
    prepare = Launch(
        gdn_chunk_prepare,
        grid=(chunks, shape.num_v_heads),
        block=((chunk // TILE_ENTRIES) ** 2,),
        args=(
            projection,
            flat_mixed,
            weights.ssm_a,
            weights.dt_bias,
            flat_w,
            workspace.qk,
            workspace.decay,
            flat_out,
            num_k_heads,
            chunk32,
        ),
    )
    state = Launch(
        gdn_chunk_state,
        grid=(shape.num_v_heads, shape.v_head_dim // STATE_COLUMNS),
        block=(max(2 * chunk, shape.k_head_dim),),
        args=(flat_mixed, flat_w, workspace.decay, flat_out, flat_states, delta_state, slot32, num_k_heads, chunk32),
    )
    output = Launch(
        gdn_chunk_output,
        grid=(shape.v_head_dim // OUTPUT_COLUMNS, shape.num_v_heads, chunks),
        block=(2 * chunk,),
        args=(
            flat_mixed,
            workspace.qk.reshape(-1),
            workspace.decay,
            flat_states,
            flat_out,
            num_k_heads,
            np.int32(shape.k_head_dim),
            np.int32(shape.v_head_dim),
            chunk32,
        ),
    )
    return [conv, prepare, state, output, norm]


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
    recurrence alone (prepare + state pass + output against the token loop). `decode_prompt_us` times the decode
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
    result["chunked_recurrence_us"] = sum(
        result[f"{name}_us"] for name in ("gdn_chunk_prepare", "gdn_chunk_state", "gdn_chunk_output")
    )
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
        f"{'prepare':>9} {'state':>9} {'output':>9} {'token rec':>9} {'rec ratio':>9} {'conv':>8} {'norm':>8} "
        f"{'decode':>10}"
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
                f"{r['gdn_chunk_prepare_us']:>9.1f} {r['gdn_chunk_state_us']:>9.1f} {r['gdn_chunk_output_us']:>9.1f} "
                f"{r['sequential_recurrence_us']:>9.1f} {r['recurrence_speedup']:>9.2f} "
                f"{r['gdn_prefill_conv_us']:>8.1f} {r['gdn_prefill_gated_norm_us']:>8.1f} "
                f"{r['decode_prompt_us']:>10.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
