"""Constants, shared-memory sizes and device helpers shared by the chunked and token-by-token GDN prefill kernels."""

from __future__ import annotations

from numba import cuda, float32

from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.kernels.gated_deltanet import MAX_HEAD_DIM, ROWS_PER_THREAD

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

ALIGN = None if SIMULATOR else 16  # 16-byte shared arrays for the vector loads (the simulator takes no alignment)

ROW_STRIDE = MAX_HEAD_DIM + 1  # per-token rows of squares

GRAM_STRIDE = GRAM_COLUMNS + 4  # padded rows, multiples of 4 (16-byte rows) and 4 banks apart

WIDE_STRIDE = MAX_CHUNK + 4

_TILE_STRIDE_MAX = MAX_KEY_DIM + 4

ZERO = float32(0.0)

ONE = float32(1.0)

CONV_SQUARES = CONV_TOKENS * ROW_STRIDE

NORM_SQUARES = NORM_TOKENS * ROW_STRIDE

CONV_PARTIALS = CONV_TOKENS * REDUCE_PARTS

NORM_PARTIALS = NORM_TOKENS * REDUCE_PARTS

GRAM_STAGE = 2 * MAX_CHUNK * GRAM_STRIDE  # K and Q; later A (64 x 65) and the W/U stage (64 x 68)

WIDE_SIZE = MAX_CHUNK * WIDE_STRIDE

TILE_ENTRIES_2D = TILE_ENTRIES * TILE_ENTRIES

STATE_TILE = MAX_CHUNK * _TILE_STRIDE_MAX

STATE_SLICE = MAX_KEY_DIM * STATE_COLUMNS

DELTA_SLICE = MAX_CHUNK * STATE_COLUMNS

PREFETCH_VALUES = 4 * PREFETCH

OUTPUT_Q = MAX_CHUNK * WIDE_STRIDE

OUTPUT_S = MAX_CHUNK * (OUTPUT_COLUMNS + 4)

OUTPUT_STRIDE = OUTPUT_COLUMNS + 4

OUTPUT_QUADS_LOG2 = (OUTPUT_COLUMNS // 4).bit_length() - 1

STAGE_VALUES = 4 * STAGE_BATCH

STAGED_KEYS = STAGED_TOKENS * MAX_KEY_DIM

STAGED_VALUES = STAGED_TOKENS * COLUMN_TILE

PARTIALS = 2 * 3 * MAX_GROUPS * COLUMN_TILE  # u, S'^T q and k.q per row group, double-buffered


@cuda.jit(device=True, inline=True)
def log2(n):
    """log2 of a power of two: staging loops split an index into row and quad with a shift and a mask, where a
    division by a runtime width costs ~20 instructions (check_prefill_shape keeps dk and C powers of two)."""
    result = 0
    while (1 << result) < n:
        result += 1
    return result


@cuda.jit(device=True, inline=True)
def sum_squares(squares, partials, norms, width, lane, lanes):
    """partials[s*8 + p] = sum of squares[s][c] for c = p (mod 8); then norms[s] = the sum over p. Two barriers;
    every thread of the block calls it."""
    for e in range(lane, CONV_TOKENS * REDUCE_PARTS, lanes):
        s = e // REDUCE_PARTS
        total = ZERO
        for c in range(e % REDUCE_PARTS, width, REDUCE_PARTS):
            total += squares[s * ROW_STRIDE + c]
        partials[e] = total
    cuda.syncthreads()
    if lane < CONV_TOKENS:
        total = ZERO
        for p in range(REDUCE_PARTS):
            total += partials[lane * REDUCE_PARTS + p]
        norms[lane] = total
    cuda.syncthreads()
