"""Q8_0 GEMV for one token with the input's RMSNorm and int8 quantisation fused in (decode at batch 1).

    y (=, += or SwiGLU) W · quantize(x * (1 / sqrt(mean(x²) + eps)) * norm_weight)    (`norm_weight` given)
    y (=, += or SwiGLU) W · quantize(x)                                                  (otherwise)

Why: at batch 1 every GEMV input used to be prepared by its own launch (RMSNorm+quantise before the
mixer, the MLP and the LM head; quantise before ssm_out, attn_output and ffn_down): 129 launches of 4-9 µs
beside the 129 GEMVs of a 9B step. Here each thread block quantises the input into shared memory itself,
from the fp32 row (at most 68 KB, an L2 hit for every block but the first), so those launches are gone.

Numerics are those of the unfused kernels (`quantize.py`), hence of the reference's int8 path: the sum of
squares is accumulated in the same order as `rms_norm_quantize` with 256 threads (each thread words
tid, tid + 256, ... and their four values in order, then the warp butterfly, then the warps in order),
so on a GPU the normalisation factor, the quants and the scales are bit for bit what those kernels give;
the weight loop and the reduction are gemv.py's, unchanged.

Tiling: a persistent grid of at most BLOCKS_PER_SM blocks per SM, 8 warps (256 threads) each. A block
quantises the whole row once into dynamic shared memory (cols bytes of quants, transposed within each
128-word step as gemv.py stages them, then cols/8 bytes of fp32 scales; the row is padded with zeros to a
whole number of 256-word iterations), then its warps take row pairs in grid-stride order and stream them
exactly as gemv.py's T=1 kernel does. Staging and the sum of squares issue four rounds of 16-byte loads
before using any, so the prologue costs about two L2 round trips, not one per round.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from cmpchat.cuda.compile import kernel
from cmpchat.cuda.intrinsics import SIMULATOR, WARP_SIZE, dp4a, load_f32x4, load_u32x4, shfl_xor_f32, warp_sum_f32
from cmpchat.cuda.kernels.gemv import (
    MODE_ACCUMULATE,
    MODE_SWIGLU,
    STEP_WORDS,
    U16,
    U32,
    U64,
    U96,
    U128,
    UNROLL,
    check_aligned,
    check_mode,
    fold,
    output_shape,
    pair_rows,
    silu_f32,
)
from cmpchat.cuda.kernels.quantize import QUANT_BLOCK, VALUES_PER_WORD, block_amax, quantize_word
from cmpchat.cuda.launch import Launch, check_array

# 8 warps on a GPU (the sum of squares' order assumes 256 threads); the simulator runs 2-warp blocks.
WARPS_PER_BLOCK = 2 if SIMULATOR else 8
BLOCK_THREADS = WARPS_PER_BLOCK * WARP_SIZE
BLOCKS_PER_SM = 3
"""Resident blocks per SM the grid is sized for (registers allow 3 blocks of 256 threads at T=1)."""
LOAD_ROUNDS = 4
"""Rounds of 16-byte loads the prologue issues before using them."""
LOAD_VALUES = 4 * LOAD_ROUNDS  # a plain constant: Numba needs literal local-array sizes
ITERATION_WORDS = UNROLL * STEP_WORDS
MAX_COLUMNS = 40960
"""Widest input: its staged form must fit the 48 KB of dynamic shared memory a launch gets by default."""

GEMV_FUSED_SIGNATURE = (
    "void(uint32[::1], float16[::1], float32[::1], float32[::1], float32[::1], int32, int32, int32, float32, int32)"
)


@cuda.jit(device=True, inline=True)
def staged_index(word):
    """Where word `word` of the row lives in shared memory: within each 128-word step, word 4l+c at 32c+l."""
    offset = word & (STEP_WORDS - 1)
    return (word & ~(STEP_WORDS - 1)) + (offset >> 2) + ((offset & 3) << 5)


@kernel(GEMV_FUSED_SIGNATURE)
def gemv_q8_fused(wq, ws, x, norm_weight, y, rows, words, mode, eps, use_norm):
    tid = cuda.threadIdx.x
    lane = tid & (WARP_SIZE - 1)
    padded = (words + ITERATION_WORDS - 1) // ITERATION_WORDS * ITERATION_WORDS
    stage_q = cuda.shared.array(0, uint32)
    stage_s = cuda.shared.array(0, float32)[padded:]  # after the quants (dynamic shared arrays alias)
    values = cuda.local.array(LOAD_VALUES, float32)
    weights = cuda.local.array(LOAD_VALUES, float32)
    rounds = (padded + BLOCK_THREADS - 1) // BLOCK_THREADS  # the same for every thread

    factor = float32(1.0)
    if use_norm != 0:
        partial = float32(0.0)
        for first in range(0, rounds, LOAD_ROUNDS):
            for u in range(LOAD_ROUNDS):
                word = (first + u) * BLOCK_THREADS + tid
                v0 = v1 = v2 = v3 = float32(0.0)
                if word < words:
                    v0, v1, v2, v3 = load_f32x4(x, uint64(4 * word))
                values[4 * u], values[4 * u + 1], values[4 * u + 2], values[4 * u + 3] = v0, v1, v2, v3
            for i in range(LOAD_VALUES):
                partial += values[i] * values[i]  # adding the zeros of dead words changes nothing
        totals = cuda.shared.array(WARPS_PER_BLOCK, float32)
        warp_total = warp_sum_f32(partial)
        if lane == 0:
            totals[tid >> 5] = warp_total
        cuda.syncthreads()
        total = float32(0.0)
        for w in range(WARPS_PER_BLOCK):
            total += totals[w]
        factor = float32(1.0) / math.sqrt(total / float32(4 * words) + eps)

    for first in range(0, rounds, LOAD_ROUNDS):
        for u in range(LOAD_ROUNDS):
            word = (first + u) * BLOCK_THREADS + tid
            v0 = v1 = v2 = v3 = float32(0.0)
            w0 = w1 = w2 = w3 = float32(0.0)
            if word < words:
                v0, v1, v2, v3 = load_f32x4(x, uint64(4 * word))
                if use_norm != 0:
                    w0, w1, w2, w3 = load_f32x4(norm_weight, uint64(4 * word))
            values[4 * u], values[4 * u + 1], values[4 * u + 2], values[4 * u + 3] = v0, v1, v2, v3
            weights[4 * u], weights[4 * u + 1], weights[4 * u + 2], weights[4 * u + 3] = w0, w1, w2, w3
        for u in range(LOAD_ROUNDS):
            word = (first + u) * BLOCK_THREADS + tid
            v0, v1, v2, v3 = values[4 * u], values[4 * u + 1], values[4 * u + 2], values[4 * u + 3]
            if use_norm != 0:  # the order of rms_norm_quantize: (x * factor) * weight
                v0 = v0 * factor * weights[4 * u]
                v1 = v1 * factor * weights[4 * u + 1]
                v2 = v2 * factor * weights[4 * u + 2]
                v3 = v3 * factor * weights[4 * u + 3]
            amax = block_amax(v0, v1, v2, v3)  # every thread takes part (the simulator's shuffle is a barrier)
            packed, scale = quantize_word(v0, v1, v2, v3, amax)
            if word < padded:  # padding words quantise zeros: quants 0, scale 0
                stage_q[uint64(staged_index(word))] = packed
                if (word & 7) == 0:
                    stage_s[uint64(word >> 3)] = scale
    cuda.syncthreads()

    # Row pairs in grid-stride order; every warp of a block runs the same number of iterations (dead pairs
    # read a live row and store nothing), as the simulator's block-wide shuffles need.
    pairs = rows >> 1 if mode == MODE_SWIGLU else (rows + 1) >> 1
    all_warps = cuda.gridDim.x * WARPS_PER_BLOCK
    blocks = words >> 3
    acc = cuda.local.array(2, float32)
    for first_pair in range(cuda.blockIdx.x * WARPS_PER_BLOCK, pairs, all_warps):
        pair = first_pair + (tid >> 5)
        row_a, row_b, out_rows = pair_rows(pair, rows, mode)
        live_a = row_a < out_rows if mode == MODE_SWIGLU else row_a < rows
        quants_a = min(row_a, rows - 1) * words
        quants_b = min(row_b, rows - 1) * words
        scales_a = min(row_a, rows - 1) * blocks
        scales_b = min(row_b, rows - 1) * blocks
        acc[0] = acc[1] = float32(0.0)
        for step in range(0, words, ITERATION_WORDS):
            k0 = step + 4 * lane
            k1 = k0 + STEP_WORDS
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = uint32(0)
            c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = uint32(0)
            sa0 = sb0 = sa1 = sb1 = float32(0.0)
            if k0 < words:
                a0, a1, a2, a3 = load_u32x4(wq, uint64(quants_a + k0))
                b0, b1, b2, b3 = load_u32x4(wq, uint64(quants_b + k0))
                sa0 = float32(ws[uint64(scales_a + (k0 >> 3))])
                sb0 = float32(ws[uint64(scales_b + (k0 >> 3))])
            if k1 < words:
                c0, c1, c2, c3 = load_u32x4(wq, uint64(quants_a + k1))
                d0, d1, d2, d3 = load_u32x4(wq, uint64(quants_b + k1))
                sa1 = float32(ws[uint64(scales_a + (k1 >> 3))])
                sb1 = float32(ws[uint64(scales_b + (k1 >> 3))])
            q = uint64(step + lane)
            s = uint64((step + 4 * lane) >> 3)
            x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
            xs0 = stage_s[s]
            dot_a = dp4a(a3, x3, dp4a(a2, x2, dp4a(a1, x1, dp4a(a0, x0, 0))))
            dot_b = dp4a(b3, x3, dp4a(b2, x2, dp4a(b1, x1, dp4a(b0, x0, 0))))
            acc[0] += float32(dot_a) * (sa0 * xs0)
            acc[1] += float32(dot_b) * (sb0 * xs0)
            q += U128
            x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
            xs1 = stage_s[s + U16]
            dot_a = dp4a(c3, x3, dp4a(c2, x2, dp4a(c1, x1, dp4a(c0, x0, 0))))
            dot_b = dp4a(d3, x3, dp4a(d2, x2, dp4a(d1, x1, dp4a(d0, x0, 0))))
            acc[0] += float32(dot_a) * (sa1 * xs1)
            acc[1] += float32(dot_b) * (sb1 * xs1)

        # gemv.py's reduce-scatter at T=1: after it, lanes 0-15 hold row a's sum and lanes 16-31 row b's.
        fold(acc, lane, 16, 2)
        fold(acc, lane, 8, 1)
        fold(acc, lane, 4, 1)
        fold(acc, lane, 2, 1)
        fold(acc, lane, 1, 1)
        total = acc[0]
        partner = shfl_xor_f32(total, 16)
        if (lane & 15) == 0:
            if mode == MODE_SWIGLU:
                if lane == 0 and live_a:
                    y[uint64(row_a)] = silu_f32(total) * partner
            else:
                row = row_a if lane == 0 else row_b
                if row_a < rows and row < rows:
                    if mode == MODE_ACCUMULATE:
                        y[uint64(row)] += total
                    else:
                        y[uint64(row)] = total


def shared_bytes(cols: int) -> int:
    """Dynamic shared memory of a launch: the padded row's quants and its scales."""
    words = cols // VALUES_PER_WORD
    padded = -(-words // ITERATION_WORDS) * ITERATION_WORDS
    return 4 * padded + 4 * (padded // 8)


def gemv_q8_fused_launch(
    weight_quants: Any,
    weight_scales: Any,
    x: Any,
    out: Any,
    *,
    mode: str = "store",
    norm_weight: Any | None = None,
    eps: float = 0.0,
    sm_count: int,
) -> Launch:
    """y = W x̂ for one fp32 token x [1, cols] (x̂: RMSNorm'd with `norm_weight` when given, then quantised).

    mode "store" writes out [1, rows]; "accumulate" adds into it; "swiglu" takes W = [gate | up] stacked
    along rows and writes silu(gate x̂) * (up x̂) into out [1, rows/2]. Weight layouts as gemv.py's.
    """
    rows, words = check_array(weight_quants, "weight quants", np.uint32, 2)
    cols = words * VALUES_PER_WORD
    if rows == 0 or cols == 0 or cols % QUANT_BLOCK or cols > MAX_COLUMNS:
        raise ValueError(f"weight quants must be [rows, cols/4] with cols a multiple of 32 up to {MAX_COLUMNS}")
    check_array(weight_scales, "weight scales", np.float16, 2, (rows, cols // QUANT_BLOCK))
    check_array(x, "x", np.float32, 2, (1, cols))
    code = check_mode(mode, rows)
    check_array(out, "out", np.float32, 2, output_shape(rows, 1, mode))
    if norm_weight is not None:
        check_array(norm_weight, "norm weight", np.float32, 1, (cols,))
        check_aligned(norm_weight, "norm weight")
    for array, name in ((weight_quants, "weight quants"), (x, "x")):
        check_aligned(array, name)
    pairs = rows // 2 if mode == "swiglu" else (rows + 1) // 2
    grid = max(1, min(-(-pairs // WARPS_PER_BLOCK), sm_count * BLOCKS_PER_SM))
    args = (
        weight_quants.reshape(-1), weight_scales.reshape(-1), x.reshape(-1),
        (x if norm_weight is None else norm_weight).reshape(-1), out.reshape(-1), np.int32(rows),
        np.int32(words), np.int32(code), np.float32(eps), np.int32(norm_weight is not None),
    )  # fmt: skip
    return Launch(gemv_q8_fused, grid, BLOCK_THREADS, args, shared_bytes(cols))
