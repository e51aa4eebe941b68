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

Tiling (`FusedGemvTiling`): a persistent grid of `blocks_per_sm` blocks per SM, each of `groups` groups of 8
warps (256 threads; the first group adds the sum of squares). A block quantises the whole row once into
dynamic shared memory (cols bytes of quants, transposed within each 128-word step as gemv.py stages them,
then cols/8 bytes of fp32 scales; the row is padded with zeros to whole loop iterations), then its warps
stream row pairs as gemv.py's T=1 kernel does, `steps` 512-byte steps per row per iteration. The pairs are
dealt round the blocks, so each SM streams the same share of the matrix give or take a pair per block
(handing each block consecutive pairs left up to a quarter of the SMs idle at the end of 27B's ffn down).
The per-lane sums add the steps in the same order whatever the variant, so every variant gives the same bits.
Staging and the sum of squares issue four rounds of 16-byte loads before using any, and the staging's first
four go out with the sum's, so the prologue costs about one L2 round trip, not one per round. Which tiling a
launch takes is the device's choice (`DeviceTuning.gemv_tiling`, `device_table.py`): on every GPU so far, inputs
wider than 4096 with more row pairs than 16 warps per SM take one 24-warp block per SM, the rest one 16-warp block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import cuda, float32, int32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    SIMULATOR,
    WARP_SIZE,
    allow_dependent_grids,
    block_sum_f32,
    dp4a,
    launched_early_here,
    load_f32x4,
    load_u32x4,
    prefetch_l2,
    shfl_xor_f32,
    wait_for_prior_grids,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.gemv import (
    MODE_ACCUMULATE,
    MODE_SWIGLU,
    STEP_WORDS,
    U32,
    U64,
    U96,
    check_aligned,
    check_mode,
    fold,
    output_shape,
    pair_rows,
    row_pairs,
    silu_f32,
    staged_index,
)
from cmpchat.kernels.gemv_kquant import (
    FORMATS,
    KQUANT_TYPES,
    NIBBLE_WORDS,
    ONES,
    KQuantArrays,
    KQuantFormat,
    block_reader,
    check_kquant_arrays,
)
from cmpchat.kernels.quantize import QUANT_BLOCK, VALUES_PER_WORD, block_amax, quantize_word

NORM_THREADS = 64 if SIMULATOR else 256
"""Threads that add the sum of squares: rms_norm_quantize's block, so the order, hence the bits, are its own
(the simulator runs 2-warp groups)."""
GROUP_WARPS = NORM_THREADS // WARP_SIZE
LOAD_ROUNDS = 4
"""Rounds of 16-byte loads the prologue issues before using them."""
LOAD_VALUES = 4 * LOAD_ROUNDS  # a plain constant: Numba needs literal local-array sizes
STEP_CHOICES = (2, 4)
"""Compiled variants: 512-byte steps per row each loop iteration loads before using any."""
GROUP_CHOICES = (1, 2, 3)
"""Compiled variants: blocks of 1-3 groups of 8 warps (2 in the simulator)."""
SM_THREADS = 768
"""Threads of the fused GEMV an SM holds at most: each variant is compiled (`launch_bounds`) for its block size
and as many blocks as make SM_THREADS, so ptxas may use as many registers as still fit them all (80 for 256-
and 768-thread blocks, 107 of 128 for the 512-thread one). Told that, it issues the weight loads earlier
than when left to keep to 56-72 registers (H200: the 27B step's GEMVs 8.23 -> 8.07 ms, 9B 2.73 -> 2.71 ms);
1024 threads would leave 64, fewer than the loop needs."""
PREFETCH_STEPS = 2
"""512-byte steps of each row of its first pair a warp prefetches into L2 before waiting for the launch before
(H200, early launches on, 9B/27B steps: 2.862/8.596 ms without, 2.830/8.505 with 2, 2.846/8.548 with 4; the
rows' first scales too: 2.842/8.522 -> 2.826/8.490 ms, and 0.3-0.5% less at 4K tokens)."""
PREFETCH_LANE_STRIDE = 8
"""One lane in 8 prefetches: 8 lanes' 16-byte words make one 128-byte L2 line (as fast as every lane)."""
MAX_COLUMNS = 40960
"""Widest input: its staged form must fit the 48 KB of dynamic shared memory a launch gets by default."""

GEMV_FUSED_SIGNATURE = (
    "void(uint32[::1], float16[::1], float32[::1], float32[::1], float32[::1], int32, int32, int32, float32, int32)"
)
GEMV_FUSED_KQUANT_SIGNATURE = (
    "void(uint32[::1], uint32[::1], uint16[::1], float16[::1], float32[::1], float32[::1], float32[::1], int32, "
    "int32, int32, float32, int32, int32)"
)
KQUANT_STEP_WORDS = WARP_SIZE * 8  # input words a 4/5/6-bit step covers: one 32-value block a lane


@dataclass(frozen=True, slots=True)
class FusedGemvTiling:
    """How the kernel is cut up: fixed per launch, chosen by measurement (`gemv_bench --sweep`)."""

    steps: int = 4
    """512-byte steps per row in one loop iteration: 16-byte loads in flight per lane = 2 x steps."""
    blocks_per_sm: int = 3
    """Blocks per SM of the persistent grid; all of them must fit on an SM at once (at most SM_THREADS
    threads), or the last would start late with their share of the rows."""
    groups: int = 1
    """Groups of 8 warps per block. Every block stages the whole input, so fewer, larger blocks read it
    from L2 fewer times, and more threads share the staging."""

    def __post_init__(self) -> None:
        if self.steps not in STEP_CHOICES or self.groups not in GROUP_CHOICES or self.blocks_per_sm < 1:
            raise ValueError(
                f"steps must be one of {STEP_CHOICES}, groups one of {GROUP_CHOICES} and blocks_per_sm >= 1, got {self}"
            )
        if self.blocks_per_sm * self.block_threads > SM_THREADS:
            raise ValueError(f"{self} puts more than {SM_THREADS} threads on an SM: its blocks would not all fit")

    @property
    def block_threads(self) -> int:
        return self.groups * NORM_THREADS

    @property
    def label(self) -> str:
        return f"{self.steps}s{self.groups}gx{self.blocks_per_sm}"


@cuda.jit(device=True, inline=True)
def load_staging_round(x, norm_weight, use_norm, words, first_word, stride, values, weights):
    """LOAD_ROUNDS 16-byte loads of x (and the norm weight) at first_word + u * stride, zeros past the row end."""
    for u in range(LOAD_ROUNDS):
        word = first_word + u * stride
        v0 = v1 = v2 = v3 = float32(0.0)
        w0 = w1 = w2 = w3 = float32(0.0)
        if word < words:
            v0, v1, v2, v3 = load_f32x4(x, uint64(4 * word))
            if use_norm != 0:
                w0, w1, w2, w3 = load_f32x4(norm_weight, uint64(4 * word))
        values[4 * u], values[4 * u + 1], values[4 * u + 2], values[4 * u + 3] = v0, v1, v2, v3
        weights[4 * u], weights[4 * u + 1], weights[4 * u + 2], weights[4 * u + 3] = w0, w1, w2, w3


@cuda.jit(device=True, inline=True)
def kquant_staged_index(word):
    """Where word `word` of a staged row lives for the 4/5/6-bit loop (`gemv_kquant`'s staging): within each step
    of 32 blocks, word c of block 32s + l at 256s + 32c + l (a lane's 8 shared loads hit 8 distinct banks)."""
    return ((word >> 8) << 8) + ((word & 7) << 5) + ((word >> 3) & 31)


def iteration_words(steps: int, kquant: bool) -> int:
    """Input words one loop iteration covers: steps of 512 bytes of Q8_0 weight a row (128 words), or of one
    32-value block a lane (256 words) for the 4/5/6-bit types."""
    return steps * (KQUANT_STEP_WORDS if kquant else STEP_WORDS)


def _fused_body(steps: int, groups: int, fmt: KQuantFormat | None) -> Any:
    """The kernel's body as a device function over Q8_0 weights (fmt None: w_a the quants, w_d the scales) or a
    4/5/6-bit type (w_a..w_d: `gemv_kquant`'s nibbles, high, sub_scales, scales), y[out_first + row]. A 4/5/6-bit
    lane reads one whole block a step (its 16 bytes of nibbles, high bits and scales), so the prologue also
    stages xs * sum(x) per block for the types with a minimum."""
    kquant = fmt is not None
    has_min = fmt is not None and fmt.has_min
    iteration = iteration_words(steps, kquant)
    block_threads = groups * NORM_THREADS
    block_warps = groups * GROUP_WARPS
    step_words = 4 * steps  # weight words per row a lane holds per iteration (a plain constant for Numba)
    high_words = 2 * steps if kquant else 1
    extra_scales = steps if kquant else 1
    if fmt is not None:
        read_block, block_words, block_term = block_reader(fmt)
    staged_at = kquant_staged_index if kquant else staged_index

    @cuda.jit(device=True, inline=True)
    def body(w_a, w_b, w_c, w_d, x, norm_weight, y, rows, words, mode, eps, use_norm, out_first):
        tid = cuda.threadIdx.x
        lane = tid & (WARP_SIZE - 1)
        padded = (words + iteration - 1) // iteration * iteration
        stage_q = cuda.shared.array(0, uint32)
        stage_s = cuda.shared.array(0, float32)[padded:]  # after the quants (dynamic shared arrays alias)
        stage_m = cuda.shared.array(0, float32)[padded + (padded >> 3) :]  # xs * sum(x) (types with a minimum)
        values = cuda.local.array(LOAD_VALUES, float32)
        weights = cuda.local.array(LOAD_VALUES, float32)
        squared = cuda.local.array(LOAD_VALUES, float32)
        rounds = (padded + block_threads - 1) // block_threads  # the same for every thread

        # Launched early (sm_90+): the weights are no launch's output, so the first loop steps of the warp's first
        # pair are on their way to L2 while the launch before still runs; x and y are, so nothing touches them
        # before the wait. Dependents may start at once: they can only take the room this block leaves.
        allow_dependent_grids()
        pairs = rows >> 1 if mode == MODE_SWIGLU else (rows + 1) >> 1
        blocks = words >> 3
        grid = cuda.gridDim.x
        own_pair = (tid >> 5) * grid + cuda.blockIdx.x
        # Not below sm_90: with no early launch the prefetch would delay the prologue (2-8% slower steps, H200).
        if launched_early_here() and own_pair < pairs and lane % PREFETCH_LANE_STRIDE == 0:
            row_a, row_b, _ = pair_rows(own_pair, rows, mode)
            for u in range(PREFETCH_STEPS):
                if kquant:  # the nibbles of the lane's blocks (4 words a block)
                    k = min(u * WARP_SIZE + lane, blocks - 1) * NIBBLE_WORDS
                    prefetch_l2(w_a, uint64(min(row_a, rows - 1) * blocks * NIBBLE_WORDS + k))
                    prefetch_l2(w_a, uint64(min(row_b, rows - 1) * blocks * NIBBLE_WORDS + k))
                else:
                    k = min(u * STEP_WORDS + 4 * lane, words - 4)
                    prefetch_l2(w_a, uint64(min(row_a, rows - 1) * words + k))
                    prefetch_l2(w_a, uint64(min(row_b, rows - 1) * words + k))
            if lane == 0 and not kquant:  # and the rows' first scales (one line: 64 of them)
                prefetch_l2(w_d, uint64(min(row_a, rows - 1) * blocks))
                prefetch_l2(w_d, uint64(min(row_b, rows - 1) * blocks))
        wait_for_prior_grids()

        # The staging's first round of loads goes out before the sum of squares' loads, so both wait on one L2
        # round trip (H200: 27B/9B steps 8.413/2.819 -> 8.365/2.798 ms).
        load_staging_round(x, norm_weight, use_norm, words, tid, block_threads, values, weights)
        factor = float32(1.0)
        if use_norm != 0:
            # The first NORM_THREADS threads add the squares in rms_norm_quantize's order; the others add
            # nothing, and the zeros of their warps, added last in order, leave the block's total as it was.
            partial = float32(0.0)
            norm_rounds = (words + NORM_THREADS - 1) // NORM_THREADS if tid < NORM_THREADS else 0
            for first in range(0, norm_rounds, LOAD_ROUNDS):
                for u in range(LOAD_ROUNDS):
                    word = (first + u) * NORM_THREADS + tid
                    v0 = v1 = v2 = v3 = float32(0.0)
                    if word < words:
                        v0, v1, v2, v3 = load_f32x4(x, uint64(4 * word))
                    squared[4 * u], squared[4 * u + 1], squared[4 * u + 2], squared[4 * u + 3] = v0, v1, v2, v3
                for i in range(LOAD_VALUES):
                    partial += squared[i] * squared[i]  # adding the zeros of dead words changes nothing
            total = block_sum_f32(partial)  # rms_norm_quantize's order: warps, then the warps in order
            factor = float32(1.0) / math.sqrt(total / float32(4 * words) + eps)

        for first in range(0, rounds, LOAD_ROUNDS):
            if first > 0:
                load_staging_round(x, norm_weight, use_norm, words, first * block_threads + tid, block_threads,
                                   values, weights)  # fmt: skip
            for u in range(LOAD_ROUNDS):
                if first + u >= rounds:  # the same for every thread: dead rounds only quantised zeros (on 27B's
                    break  # 5120-column inputs 2 of 4 at 24 warps; skipping them saved ~2 µs a launch, H200)
                word = (first + u) * block_threads + tid
                v0, v1, v2, v3 = values[4 * u], values[4 * u + 1], values[4 * u + 2], values[4 * u + 3]
                if use_norm != 0:  # the order of rms_norm_quantize: (x * factor) * weight
                    v0 = v0 * factor * weights[4 * u]
                    v1 = v1 * factor * weights[4 * u + 1]
                    v2 = v2 * factor * weights[4 * u + 2]
                    v3 = v3 * factor * weights[4 * u + 3]
                amax = block_amax(v0, v1, v2, v3)  # every thread takes part (the simulator's shuffle is a barrier)
                packed, scale = quantize_word(v0, v1, v2, v3, amax)
                if has_min:  # the block's sum of quants over its 8 words' lanes (exact in fp32: |sum| < 2^12)
                    summed = float32(dp4a(packed, ONES, int32(0)))
                    summed += shfl_xor_f32(summed, 1)
                    summed += shfl_xor_f32(summed, 2)
                    summed += shfl_xor_f32(summed, 4)
                if word < padded:  # padding words quantise zeros: quants 0, scale 0
                    stage_q[uint64(staged_at(word))] = packed
                    if (word & 7) == 0:
                        stage_s[uint64(word >> 3)] = scale
                        if has_min:
                            stage_m[uint64(word >> 3)] = scale * summed
        cuda.syncthreads()

        # Row pairs dealt round the blocks first (pair p to block p % grid), so every SM streams as many rows
        # as any other, give or take one pair per block. A warp past the last pair stops; in the simulator,
        # whose shuffles are block-wide barriers, it runs on with a live row and stores nothing.
        all_warps = grid * block_warps
        acc = cuda.local.array(2, float32)
        weight_a = cuda.local.array(step_words, uint32)
        weight_b = cuda.local.array(step_words, uint32)
        scale_a = cuda.local.array(steps, float32)
        scale_b = cuda.local.array(steps, float32)
        high_a = cuda.local.array(high_words, uint32)  # 4/5/6-bit: each step's high words, second S and M
        high_b = cuda.local.array(high_words, uint32)
        second_a = cuda.local.array(extra_scales, float32)
        second_b = cuda.local.array(extra_scales, float32)
        min_a = cuda.local.array(extra_scales, float32)
        min_b = cuda.local.array(extra_scales, float32)
        for first_pair in range(0, pairs, all_warps):
            pair = first_pair + (tid >> 5) * grid + cuda.blockIdx.x
            if pair >= pairs and not SIMULATOR:
                break
            row_a, row_b, out_rows = pair_rows(pair, rows, mode)
            live_a = row_a < out_rows if mode == MODE_SWIGLU else row_a < rows
            read_a, read_b = min(row_a, rows - 1), min(row_b, rows - 1)
            acc[0] = acc[1] = float32(0.0)
            for step in range(0, words, iteration):
                # All loads first (2 x steps 16-byte loads per lane in flight). Past the row end a lane reads the
                # row's last words again, which meet the staged zeros. Unconditional, because with a predicate per
                # step ptxas (sm_90 SASS) reused predicate registers and waited for one step's scales before
                # issuing the next step's loads: the 27B step's GEMVs took 8.5 ms instead of 8.2 (H200).
                for u in range(steps):
                    if kquant:
                        block = min((step >> 3) + u * WARP_SIZE + lane, blocks - 1)
                        a0, a1, a2, a3, ha0, ha1, sa, sa1, ma = read_block(w_a, w_b, w_c, w_d, read_a, block, blocks)
                        b0, b1, b2, b3, hb0, hb1, sb, sb1, mb = read_block(w_a, w_b, w_c, w_d, read_b, block, blocks)
                        high_a[2 * u], high_a[2 * u + 1], high_b[2 * u], high_b[2 * u + 1] = ha0, ha1, hb0, hb1
                        second_a[u], second_b[u], min_a[u], min_b[u] = sa1, sb1, ma, mb
                    else:
                        k = min(step + u * STEP_WORDS + 4 * lane, words - 4)
                        a0, a1, a2, a3 = load_u32x4(w_a, uint64(read_a * words + k))
                        b0, b1, b2, b3 = load_u32x4(w_a, uint64(read_b * words + k))
                        sa = float32(w_d[uint64(read_a * blocks + (k >> 3))])
                        sb = float32(w_d[uint64(read_b * blocks + (k >> 3))])
                    weight_a[4 * u], weight_a[4 * u + 1], weight_a[4 * u + 2], weight_a[4 * u + 3] = a0, a1, a2, a3
                    weight_b[4 * u], weight_b[4 * u + 1], weight_b[4 * u + 2], weight_b[4 * u + 3] = b0, b1, b2, b3
                    scale_a[u], scale_b[u] = sa, sb
                for u in range(steps):
                    if kquant:
                        block = (step >> 3) + u * WARP_SIZE + lane
                        q = uint64(staged_at(8 * block))
                        x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
                        x4, x5 = stage_q[q + uint64(128)], stage_q[q + uint64(160)]
                        x6, x7 = stage_q[q + uint64(192)], stage_q[q + uint64(224)]
                        xs = stage_s[uint64(block)]
                        xm = stage_m[uint64(block)] if has_min else float32(0.0)
                        qa = block_words(weight_a[4 * u], weight_a[4 * u + 1], weight_a[4 * u + 2], weight_a[4 * u + 3],
                                         high_a[2 * u], high_a[2 * u + 1])  # fmt: skip
                        qb = block_words(weight_b[4 * u], weight_b[4 * u + 1], weight_b[4 * u + 2], weight_b[4 * u + 3],
                                         high_b[2 * u], high_b[2 * u + 1])  # fmt: skip
                        acc[0] += block_term(qa, scale_a[u], second_a[u], min_a[u], x0, x1, x2, x3, x4, x5, x6, x7,
                                             xs, xm)  # fmt: skip
                        acc[1] += block_term(qb, scale_b[u], second_b[u], min_b[u], x0, x1, x2, x3, x4, x5, x6, x7,
                                             xs, xm)  # fmt: skip
                    else:
                        q = uint64(step + u * STEP_WORDS + lane)
                        x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
                        xs = stage_s[uint64((step + u * STEP_WORDS + 4 * lane) >> 3)]
                        dot_a = dp4a(weight_a[4 * u + 3], x3, dp4a(weight_a[4 * u + 2], x2,
                                     dp4a(weight_a[4 * u + 1], x1, dp4a(weight_a[4 * u], x0, 0))))  # fmt: skip
                        dot_b = dp4a(weight_b[4 * u + 3], x3, dp4a(weight_b[4 * u + 2], x2,
                                     dp4a(weight_b[4 * u + 1], x1, dp4a(weight_b[4 * u], x0, 0))))  # fmt: skip
                        acc[0] += float32(dot_a) * (scale_a[u] * xs)
                        acc[1] += float32(dot_b) * (scale_b[u] * xs)

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
                        y[uint64(out_first + row_a)] = silu_f32(total) * partner
                else:
                    row = row_a if lane == 0 else row_b
                    if row_a < rows and row < rows:
                        if mode == MODE_ACCUMULATE:
                            y[uint64(out_first + row)] += total
                        else:
                            y[uint64(out_first + row)] = total

    return body


def _make_gemv_fused(steps: int, groups: int, tensor_type: T) -> Any:
    bounds = (groups * NORM_THREADS, SM_THREADS // (groups * NORM_THREADS))
    compile_kernel = kernel(GEMV_FUSED_SIGNATURE if tensor_type == T.Q8_0 else GEMV_FUSED_KQUANT_SIGNATURE,
                            launch_bounds=bounds, early_launch=True)  # fmt: skip
    if tensor_type == T.Q8_0:
        body = _fused_body(steps, groups, None)

        def gemv_q8_fused(wq, ws, x, norm_weight, y, rows, words, mode, eps, use_norm):
            body(wq, wq, wq, ws, x, norm_weight, y, rows, words, mode, eps, use_norm, 0)

        gemv_q8_fused.__name__ = gemv_q8_fused.__qualname__ = f"gemv_q8_fused_s{steps}g{groups}"
        return compile_kernel(gemv_q8_fused)
    body = _fused_body(steps, groups, FORMATS[tensor_type])

    def gemv_kquant_fused(nibbles, high, sub_scales, scales, x, norm_weight, y, rows, words, mode, eps, use_norm,
                          out_first):  # fmt: skip
        body(nibbles, high, sub_scales, scales, x, norm_weight, y, rows, words, mode, eps, use_norm, out_first)

    name = f"gemv_{tensor_type.name.lower()}_fused_s{steps}g{groups}"
    gemv_kquant_fused.__name__ = gemv_kquant_fused.__qualname__ = name
    return compile_kernel(gemv_kquant_fused)


GEMV_FUSED = {
    (tensor_type, steps, groups): _make_gemv_fused(steps, groups, tensor_type)
    for tensor_type in (T.Q8_0, *KQUANT_TYPES)
    for steps in STEP_CHOICES
    for groups in GROUP_CHOICES
}


def shared_bytes(cols: int, steps: int, kquant: bool = False) -> int:
    """Dynamic shared memory of a launch: the row's quants, padded with zeros to whole loop iterations of the
    variant, and its scales (for the 4/5/6-bit types also xs * sum(x) per block)."""
    words = cols // VALUES_PER_WORD
    iteration = iteration_words(steps, kquant)
    padded = -(-words // iteration) * iteration
    return 4 * padded + (8 if kquant else 4) * (padded // 8)


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
    tiling: FusedGemvTiling,
) -> Launch:
    """y = W x̂ for one fp32 token x [1, cols] (x̂: RMSNorm'd with `norm_weight` when given, then quantised).

    mode "store" writes out [1, rows]; "accumulate" adds into it; "swiglu" takes W = [gate | up] stacked
    along rows and writes silu(gate x̂) * (up x̂) into out [1, rows/2]. Weight layouts as gemv.py's. The grid
    is sized for `sm_count` SMs; `tiling` is the device's (`DeviceTuning.gemv_tiling`) or a benchmark's.
    """
    rows, words = check_array(weight_quants, "weight quants", np.uint32, 2)
    cols = words * VALUES_PER_WORD
    if rows == 0 or cols == 0 or cols % QUANT_BLOCK:
        raise ValueError("weight quants must be [rows, cols/4] with cols a multiple of 32")
    check_array(weight_scales, "weight scales", np.float16, 2, (rows, cols // QUANT_BLOCK))
    check_aligned(weight_quants, "weight quants")
    code = _check_fused_input(x, out, cols, rows, mode, norm_weight, 0)
    args = (
        weight_quants.reshape(-1), weight_scales.reshape(-1), x.reshape(-1),
        (x if norm_weight is None else norm_weight).reshape(-1), out.reshape(-1), np.int32(rows),
        np.int32(words), np.int32(code), np.float32(eps), np.int32(norm_weight is not None),
    )  # fmt: skip
    kernel_variant = GEMV_FUSED[T.Q8_0, tiling.steps, tiling.groups]
    grid = _fused_grid(rows, mode, sm_count, tiling)
    return Launch(kernel_variant, grid, tiling.block_threads, args, shared_bytes(cols, tiling.steps))


def gemv_kquant_fused_launch(
    tensor_type: T,
    arrays: KQuantArrays,
    cols: int,
    x: Any,
    out: Any,
    *,
    mode: str = "store",
    norm_weight: Any | None = None,
    eps: float = 0.0,
    out_first: int = 0,
    sm_count: int,
    tiling: FusedGemvTiling,
) -> Launch:
    """As `gemv_q8_fused_launch` for a 4/5/6-bit W (`gemv_kquant`'s layout), writing out[:, out_first:] (a part of
    a fused matrix writes its columns of a wider output)."""
    rows = int(arrays.nibbles.shape[0])
    check_kquant_arrays(tensor_type, arrays, rows, cols)
    code = _check_fused_input(x, out, cols, rows, mode, norm_weight, out_first)
    args = (
        arrays.nibbles.reshape(-1), arrays.high.reshape(-1), arrays.sub_scales.reshape(-1), arrays.scales.reshape(-1),
        x.reshape(-1), (x if norm_weight is None else norm_weight).reshape(-1), out.reshape(-1), np.int32(rows),
        np.int32(cols // VALUES_PER_WORD), np.int32(code), np.float32(eps), np.int32(norm_weight is not None),
        np.int32(out_first),
    )  # fmt: skip
    kernel_variant = GEMV_FUSED[tensor_type, tiling.steps, tiling.groups]
    grid = _fused_grid(rows, mode, sm_count, tiling)
    return Launch(kernel_variant, grid, tiling.block_threads, args, shared_bytes(cols, tiling.steps, kquant=True))


def _check_fused_input(x: Any, out: Any, cols: int, rows: int, mode: str, norm_weight: Any, out_first: int) -> int:
    """The mode's code, once x, out (its columns out_first..) and the norm weight fit a [rows, cols] weight."""
    if cols > MAX_COLUMNS:
        raise ValueError(f"the fused GEMV takes inputs of up to {MAX_COLUMNS} columns, not {cols}")
    check_array(x, "x", np.float32, 2, (1, cols))
    check_aligned(x, "x")
    code = check_mode(mode, rows)
    _, width = check_array(out, "out", np.float32, 2)
    written = output_shape(rows, 1, mode)[1]
    if int(out.shape[0]) != 1 or not 0 <= out_first <= width - written:
        raise ValueError(f"out {tuple(out.shape)} has no columns {out_first}..{out_first + written} for one token")
    if norm_weight is not None:
        check_array(norm_weight, "norm weight", np.float32, 1, (cols,))
        check_aligned(norm_weight, "norm weight")
    return code


def _fused_grid(rows: int, mode: str, sm_count: int, tiling: FusedGemvTiling) -> int:
    # No more blocks than the pairs fill: each block stages the whole input (spreading 9B's 4096-row outputs
    # over every block slot made them 0.6-1.1 µs slower on an H200).
    warps = tiling.block_threads // WARP_SIZE
    return max(1, min(-(-row_pairs(rows, mode) // warps), sm_count * tiling.blocks_per_sm))
