"""The image encoder's kernels (`cmpchat/vision/gpu_encoder.py` runs them with the DP4A GEMM between them).

The matrix products run on `gemm.py` (Q8_0 weights, int8 activations); these kernels are everything around
them, each a fusion of what `cmpchat/vision/encoder.py` (the numpy reference) does between two products:

- `vision_add_positions`: states += patch bias + the learned position table resampled to the patch's place
  in the grid (bilinear, corners aligned, as `encoder.resampled_positions`), in place after the patch GEMM.
- `vision_layer_norm_quantize`: states += a pending residual bias (the bias of the product accumulated into
  the states just before: the GEMM has no bias epilogue), written back; then LayerNorm (mean, then the mean of
  the centred squares, as the reference) with weight and bias, quantised to int8 for the next GEMM; the
  `_keep` variant also stores the normalised fp32 rows.
- `vision_bias_act_quantize`: rows += bias, then GELU-tanh, GELU-erf or nothing, quantised for the next GEMM.
- `vision_add_bias`: rows += bias in place (the merger's last product).
- `vision_rotary`: the fused q|k|v rows get their bias, q and k the 2-D rotation (half of each head's
  frequencies turn with the patch row, half with the column, a half-split rotation as `encoder._rotate`),
  q also the softmax scale hd^-1/2; in place, so attention reads q, k and v where the GEMM wrote them.
- `vision_attention_*`: bidirectional softmax attention of every patch of one image over all of its patches
  (the encoder has no windows: one image is one segment), one head per blockIdx.y: FlashAttention-style in
  fp32 FMAs (no tensor cores: docs/hardware.md), below.

Quantisation is `quantize.py`'s (`quantize_word`, `block_amax`: the same bits as `quantize_activations`).
Patch coordinates follow `encoder.patch_coordinates`: patches arrive in merge-group order, each 2x2 group of
the grid four consecutive rows, frames one after another.

Attention tiling (`AttentionTiling`; GPU values in brackets, hd = 72 in the released encoders). Issue 31: the
kernel before this one (8 lanes each owning hd/8 = 9 output dims, scalar V loads) ran at 34.8% of the H200's
FFMA peak; its P V step issued 40 shared loads per 144 FMAs.
- A block is [4] warps of 4 query groups of 8 lanes ([128] threads); it owns 16 x [4] = [64] queries of one
  head and walks the image's keys in tiles of 32. Thread (qg, lane) owns queries qg + QG*i (i < 4).
  Scores: of each key tile, keys lane + 8j (j < 4): 16 scores. P V: lane = 4 x half + dim lane; the thread
  sums the keys 8j + 4 x half + e (e, j < 4: its half of the tile) into its hd/4 [18] dims, 16-byte groups
  4 x (dim lane + 4m) (m < hd/16) and, when hd/4 is not a multiple of 4, the pair hd - 8 + 2 x dim lane:
  4 x 18 = [72] accumulators. The two halves' sums meet once, at the end (3 + hd/4 shuffles per query).
- Per 4 dims of the scores: 4 + 4 16-byte loads (Q, K) for 64 FMAs; per 4 keys of P V: 4 loads of P and
  4 x ([4] 16-byte + [1] 8-byte) of V for [288] FMAs. Shared loads per FMA: 0.125 and [0.083] (the kernel
  before: 0.125 and 0.28). Bank quads per warp load (a wavefront serves 8 distinct ones): Q 4 rows, K 8 rows,
  V 2 halves x 4 dim lanes, P 4 rows x 2 halves, each touching distinct quads (`attention_pitches`:
  Q pitch hd [72] or hd + 4 when hd/4 is a multiple of 4, K|V hd + 4, P 40 words); at most 1 wavefront per
  8 FMAs, under sm_70's 1 per 2 warp FFMAs (64 lanes, 128 bytes a cycle) and sm_90's 1 per 4.
- Softmax: online, per query, with exp2: weights 2^(s log2 e - max log2 e) (the product exact in one FMA),
  the tile max over the 8 lanes by 3 shuffles; keys past the image score -1e30 (weight 0); the running sums
  and accumulators rescaled every tile (~10 instructions per score next to its 144 FMAs).
- Pipeline (two barriers per tile, no third: each shared region's last readers are behind one of them): K
  of tile t is stored from registers, V's 16-byte global loads issued, barrier; scores; V stored; softmax,
  weights to P; the next tile's K loads issued, barrier; P V. So each load flies over a score or a P V
  phase, in 18 registers ([4.5] 16-byte loads a thread), not 36.
- Shared memory (static, fp32): Q [64 x 72], K|V [2 x 32 x 76], P [64 x 40]: [48,128 bytes] at hd 72, two
  blocks an SM on sm_70's 96 KB (the launcher takes fewer warps when a larger hd would pass 48 KB).
  Registers (ptxas, sm_70, launch bounds of 2 blocks of 128): [254], no spills: 8 warps an SM.
- Work: 2 x N^2 x hd FMAs per head (`attention_fmas`); per thread and key tile 2,304 FMAs, 240 shared
  loads, ~300 softmax and ~40 staging instructions: FMAs are ~80% of the instructions, which bounds the
  share of the FFMA peak on sm_90 (an SM sub-partition issues one instruction and one warp FFMA a cycle);
  sm_70 issues one instruction a cycle but a warp FFMA every second, so there the rest hides behind them.
  Query tiles are blockIdx.x: the blocks running together share a head, whose K and V (N x hd x 8 bytes,
  2 MB at 3520 patches) stay in L2. Grid: ceil(N / 64) x heads ([880] at 3520 patches: 3.3 waves of 264
  blocks on the H200, 6.5 of 136 on the CMP; the last wave's idle SMs are the rest of the gap to the peak).
The simulator runs one Python thread per CUDA thread: its tiling has 1 warp (4 query groups, 16 queries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    MAX_BLOCK_THREADS,
    SIMULATOR,
    WARP_SIZE,
    block_sum_f32,
    load_f32x4,
    load_shared_f32x4,
    shfl_xor_f32,
    store_shared_f32x4,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.gemv import check_aligned
from cmpchat.kernels.quantize import QUANT_BLOCK, VALUES_PER_WORD, block_amax, check_quantized, quantize_word

ACT_NONE = 0
ACT_GELU_TANH = 1
ACT_GELU_ERF = 2
ACTIVATIONS = {"none": ACT_NONE, "gelu_tanh": ACT_GELU_TANH, "gelu_erf": ACT_GELU_ERF}

ROW_THREADS = WARP_SIZE if SIMULATOR else 128
"""Threads of the row kernels (layer norm: one block a row; the others: blocks of words or columns); one warp
under the simulator, whose cost is threads x barriers (each simulated shuffle is a block barrier)."""
SHARED_ALIGNMENT = None if SIMULATOR else 16
MAX_STATIC_SHARED = 48 * 1024
_ZERO = float32(0.0)
_ONE = float32(1.0)
_HALF = float32(0.5)
_NEG = float32(-1e30)  # "no score yet"; finite so that differences never make NaN
_GELU_TANH_SCALE = float32(math.sqrt(2 / math.pi))
_GELU_CUBIC = float32(0.044715)
_SQRT_HALF = float32(math.sqrt(0.5))


# --- device helpers ----------------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def patch_row_col(patch, grid_rows, grid_cols, merge):
    """(row, column) of patch `patch` in its frame's grid (`encoder.patch_coordinates`: merge-group order)."""
    index = patch % (grid_rows * grid_cols)
    area = merge * merge
    group = index // area
    within = index - group * area
    groups_per_row = grid_cols // merge
    group_row = group // groups_per_row
    row = group_row * merge + within // merge
    col = (group - group_row * groups_per_row) * merge + within % merge
    return row, col


@cuda.jit(device=True, inline=True)
def _bilinear(index, size, side):
    """(first tap, second tap, their weights) of grid index `index` of `size` in a table of `side`, corners
    aligned, in fp32 as `encoder._bilinear_taps`."""
    source = float32(index) * float32(side - 1) / float32(max(size - 1, 1))
    base = int(source)  # floor: source >= 0
    frac = source - float32(base)
    return min(base, side - 1), min(base + 1, side - 1), _ONE - frac, frac


@cuda.jit(device=True, inline=True)
def activate(x, activation):
    """GELU as the reference writes it (tanh form, or erf), or x itself."""
    if activation == ACT_GELU_TANH:
        inner = _GELU_TANH_SCALE * (x + _GELU_CUBIC * (x * x * x))
        return _HALF * x * (_ONE + float32(math.tanh(inner)))
    if activation == ACT_GELU_ERF:
        return _HALF * x * (_ONE + float32(math.erf(x * _SQRT_HALF)))
    return x


# --- row kernels -------------------------------------------------------------------------------------------


@kernel("void(float32[:, ::1], float32[::1], float32[:, ::1], int32, int32, int32, int32)")
def vision_add_positions(states, patch_bias, table, side, grid_rows, grid_cols, merge):
    """Block (columns, patch): states[p, c] = (states[p, c] + patch_bias[c]) + position(p)[c]."""
    patch = cuda.blockIdx.y
    column = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if column >= states.shape[1]:
        return
    row, col = patch_row_col(patch, grid_rows, grid_cols, merge)
    r0, r1, wr0, wr1 = _bilinear(row, grid_rows, side)
    c0, c1, wc0, wc1 = _bilinear(col, grid_cols, side)
    position = _ZERO
    position += table[r0 * side + c0, column] * (wr0 * wc0)
    position += table[r0 * side + c1, column] * (wr0 * wc1)
    position += table[r1 * side + c0, column] * (wr1 * wc0)
    position += table[r1 * side + c1, column] * (wr1 * wc1)
    states[patch, column] = (states[patch, column] + patch_bias[column]) + position


def _make_layer_norm_quantize(keep_normalized: bool) -> Any:
    def vision_layer_norm_quantize(x, residual_bias, weight, bias, eps, quants, scales, normalized):
        row, tid, threads = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        words = quants.shape[1]
        width = x.shape[1]
        rounds = (words + threads - 1) // threads  # the same for every thread: shuffles stay uniform
        total = _ZERO
        for r in range(rounds):
            word = r * threads + tid
            if word < words:
                for j in range(VALUES_PER_WORD):
                    column = VALUES_PER_WORD * word + j
                    value = x[row, column] + residual_bias[column]
                    x[row, column] = value  # read back below by this same thread only
                    total += value
        mean = block_sum_f32(total) / float32(width)
        squares = _ZERO
        for r in range(rounds):
            word = r * threads + tid
            if word < words:
                for j in range(VALUES_PER_WORD):
                    centred = x[row, VALUES_PER_WORD * word + j] - mean
                    squares += centred * centred
        denominator = float32(math.sqrt(block_sum_f32(squares) / float32(width) + eps))
        for r in range(rounds):
            word = r * threads + tid
            live = word < words
            y0 = y1 = y2 = y3 = _ZERO
            if live:
                base = VALUES_PER_WORD * word
                y0 = (x[row, base] - mean) / denominator * weight[base] + bias[base]
                y1 = (x[row, base + 1] - mean) / denominator * weight[base + 1] + bias[base + 1]
                y2 = (x[row, base + 2] - mean) / denominator * weight[base + 2] + bias[base + 2]
                y3 = (x[row, base + 3] - mean) / denominator * weight[base + 3] + bias[base + 3]
            amax = block_amax(y0, y1, y2, y3)
            packed, scale = quantize_word(y0, y1, y2, y3, amax)
            if live:
                quants[row, word] = packed
                if word % 8 == 0:
                    scales[row, word // 8] = scale
                if keep_normalized:
                    base = VALUES_PER_WORD * word
                    normalized[row, base] = y0
                    normalized[row, base + 1] = y1
                    normalized[row, base + 2] = y2
                    normalized[row, base + 3] = y3

    name = "vision_layer_norm_quantize_keep" if keep_normalized else "vision_layer_norm_quantize"
    vision_layer_norm_quantize.__name__ = vision_layer_norm_quantize.__qualname__ = name
    signature = (
        "void(float32[:, ::1], float32[::1], float32[::1], float32[::1], float32, uint32[:, ::1], float32[:, ::1], "
        "float32[:, ::1])"
    )
    return kernel(signature)(vision_layer_norm_quantize)


vision_layer_norm_quantize = _make_layer_norm_quantize(False)
vision_layer_norm_quantize_keep = _make_layer_norm_quantize(True)


@kernel("void(float32[:, ::1], float32[::1], int32, uint32[:, ::1], float32[:, ::1])")
def vision_bias_act_quantize(x, bias, activation, quants, scales):
    """Block (words, row), a thread per word of 4 values: quantise activate(x + bias) (x is not written)."""
    row = cuda.blockIdx.y
    word = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    live = word < quants.shape[1]
    y0 = y1 = y2 = y3 = _ZERO
    if live:
        base = VALUES_PER_WORD * word
        y0 = activate(x[row, base] + bias[base], activation)
        y1 = activate(x[row, base + 1] + bias[base + 1], activation)
        y2 = activate(x[row, base + 2] + bias[base + 2], activation)
        y3 = activate(x[row, base + 3] + bias[base + 3], activation)
    amax = block_amax(y0, y1, y2, y3)  # every thread takes part (the simulator's shuffle is a block barrier)
    packed, scale = quantize_word(y0, y1, y2, y3, amax)
    if live:
        quants[row, word] = packed
        if word % 8 == 0:
            scales[row, word // 8] = scale


@kernel("void(float32[:, ::1], float32[::1])")
def vision_add_bias(x, bias):
    """Block (columns, row): x[row, c] += bias[c]."""
    row = cuda.blockIdx.y
    column = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if column < x.shape[1]:
        x[row, column] += bias[column]


@kernel("void(float32[:, ::1], float32[::1], float32[::1], int32, int32, int32, int32, float32)")
def vision_rotary(qkv, bias, inv_freq, grid_rows, grid_cols, merge, num_heads, q_scale):
    """Block per patch, a thread per (head, rotation pair): qkv [N, 3 * width] (q | k | v, heads inside each)
    gets its bias; q and k are rotated by the patch's (row, column) angles and q is scaled by `q_scale`."""
    patch = cuda.blockIdx.x
    width = qkv.shape[1] // 3
    head_dim = width // num_heads
    half = head_dim // 2
    quarter = inv_freq.shape[0]
    row, col = patch_row_col(patch, grid_rows, grid_cols, merge)
    pair = cuda.threadIdx.x
    while pair < width // 2:
        head = pair // half
        i = pair - head * half
        if i < quarter:
            angle = float32(row) * inv_freq[i]
        else:
            angle = float32(col) * inv_freq[i - quarter]
        cos = float32(math.cos(angle))
        sin = float32(math.sin(angle))
        first = head * head_dim + i
        for part in range(2):
            a = first + part * width
            b = a + half
            x1 = qkv[patch, a] + bias[a]
            x2 = qkv[patch, b] + bias[b]
            r1 = x1 * cos - x2 * sin
            r2 = x2 * cos + x1 * sin
            if part == 0:
                r1 *= q_scale
                r2 *= q_scale
            qkv[patch, a] = r1
            qkv[patch, b] = r2
        v = 2 * width + 2 * pair
        qkv[patch, v] += bias[v]
        qkv[patch, v + 1] += bias[v + 1]
        pair += cuda.blockDim.x


# --- attention ---------------------------------------------------------------------------------------------

LANES = 8
"""Threads of a query group: they share its queries; scores: 8 key lanes; P V: 2 key halves x 4 dim lanes."""
DIM_LANES = 4
THREAD_QUERIES = 4
THREAD_KEYS = 4
TILE_KEYS = LANES * THREAD_KEYS
GROUPS_PER_WARP = WARP_SIZE // LANES
_LOG2E = float32(math.log2(math.e))


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    warps: int
    """Warps of a block; it owns 16 x warps queries (4 query groups of 8 threads a warp, 4 queries each)."""

    @property
    def threads(self) -> int:
        return self.warps * WARP_SIZE

    @property
    def query_groups(self) -> int:
        return self.warps * GROUPS_PER_WARP

    @property
    def tile_queries(self) -> int:
        return self.query_groups * THREAD_QUERIES

    def shared_bytes(self, head_dim: int) -> int:
        q_pitch, kv_pitch, p_pitch = attention_pitches(head_dim)
        return 4 * (self.tile_queries * (q_pitch + p_pitch) + 2 * TILE_KEYS * kv_pitch)


def attention_pitches(head_dim: int) -> tuple[int, int, int]:
    """Row pitches in words of Q, K|V and P in shared memory (see the module docstring for the bank reasoning):
    4 consecutive Q rows and 8 consecutive K rows in distinct 16-byte bank quads, V rows 4 apart in the other
    half of the quads, P rows 2 quads apart."""
    quads = head_dim // 4  # even: head_dim is a multiple of 8
    q_pitch = head_dim + (4 if quads % 4 == 0 else 0)
    kv_pitch = head_dim + 4
    return q_pitch, kv_pitch, TILE_KEYS + 8


GPU_ATTENTION = AttentionTiling(warps=4)
"""64 queries, 128 threads, two blocks an SM at hd 72 (48,128 bytes of shared memory each: 96 KB on sm_70)."""
SIMULATOR_ATTENTION = AttentionTiling(warps=1)
"""16 queries, one warp: the same body, small enough for one Python thread per CUDA thread."""
ATTENTION_SIGNATURE = "void(float32[::1], float32[:, ::1], int32)"


@cache
def attention_kernel(head_dim: int, warps: int) -> Any:
    """The attention kernel for a head size and tiling (register arrays need constant sizes), defined and
    registered on first use."""
    tiling = AttentionTiling(warps)
    threads, query_groups, tile_queries = tiling.threads, tiling.query_groups, tiling.tile_queries
    q_pitch, kv_pitch, p_pitch = attention_pitches(head_dim)
    dims = head_dim // DIM_LANES  # output dims a thread owns: `quads` 16-byte groups and a pair
    quads = dims // 4
    pair = dims % 4 != 0  # dims = 4 * quads + 2 (head_dim a multiple of 8)
    pair_column = 4 * DIM_LANES * quads
    vectors = head_dim // 4  # 16-byte groups of a head's row
    q_size = tile_queries * q_pitch
    kv_size = 2 * TILE_KEYS * kv_pitch
    p_size = tile_queries * p_pitch
    q_loads, kv_loads = tile_queries * vectors, TILE_KEYS * vectors  # kv_loads: of K, or of V
    q_rounds, kv_rounds = -(-q_loads // threads), -(-kv_loads // threads)
    fetched_size = 4 * kv_rounds
    v_base = TILE_KEYS * kv_pitch
    scores_size = THREAD_QUERIES * THREAD_KEYS
    acc_size = THREAD_QUERIES * dims
    operand_size = 4 * THREAD_QUERIES
    unroll = 3 if (head_dim // 4) % 3 == 0 else 2  # score rounds of 4 dims per loop step (hd / 4 is even)

    @cuda.jit(device=True, inline=True)
    def fetch_rows(qkv, fetched, first_key, offset, num_patches, row_stride, tid):
        """This thread's 16-byte loads of TILE_KEYS rows (K or V) from key `first_key`; zeros past the image."""
        for r in range(kv_rounds):
            g = r * threads + tid
            x0 = x1 = x2 = x3 = _ZERO
            key = first_key + g // vectors
            if g < kv_loads and key < num_patches:
                x0, x1, x2, x3 = load_f32x4(qkv, key * row_stride + offset + 4 * (g % vectors))
            fetched[4 * r], fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3] = x0, x1, x2, x3

    @cuda.jit(device=True, inline=True)
    def stage_rows(kv, fetched, base, tid):
        """`fetch_rows`' values into the K (base 0) or V rows in shared memory."""
        for r in range(kv_rounds):
            g = r * threads + tid
            if g < kv_loads:
                store_shared_f32x4(kv, base + (g // vectors) * kv_pitch + 4 * (g % vectors), fetched[4 * r],
                                   fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3])  # fmt: skip

    @cuda.jit(device=True, inline=True)
    def score_round(qs, kv, q_values, k_values, scores, q_row, k_row, d):
        """scores[4 x 4] += this thread's queries x keys over dims d..d+3: 8 16-byte loads, 64 FMAs."""
        for i in range(THREAD_QUERIES):
            source = q_row + i * query_groups * q_pitch + d
            q_values[4 * i], q_values[4 * i + 1], q_values[4 * i + 2], q_values[4 * i + 3] = load_shared_f32x4(
                qs, source
            )
        for j in range(THREAD_KEYS):
            source = k_row + j * LANES * kv_pitch + d
            k_values[4 * j], k_values[4 * j + 1], k_values[4 * j + 2], k_values[4 * j + 3] = load_shared_f32x4(
                kv, source
            )
        for i in range(THREAD_QUERIES):
            for j in range(THREAD_KEYS):
                s = scores[THREAD_KEYS * i + j]
                for e in range(4):
                    s = cuda.fma(q_values[4 * i + e], k_values[4 * j + e], s)
                scores[THREAD_KEYS * i + j] = s

    def vision_attention(qkv, out, num_patches):
        q_tile, head = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        qg = tid // LANES
        lane = tid % LANES  # the 8 lanes of a query group are neighbours: shuffles xor 1, 2, 4
        dim_lane = lane % DIM_LANES
        half = lane // DIM_LANES  # P V: keys 8j + 4 * half + e of each tile
        width = out.shape[1]
        row_stride = 3 * width
        first_query = q_tile * tile_queries
        column = head * head_dim
        q_row = qg * q_pitch  # this thread's first query row in Q, and first key row in K
        k_row = lane * kv_pitch

        qs = cuda.shared.array(q_size, float32, alignment=SHARED_ALIGNMENT)
        kv = cuda.shared.array(kv_size, float32, alignment=SHARED_ALIGNMENT)  # K rows, then V rows
        ps = cuda.shared.array(p_size, float32, alignment=SHARED_ALIGNMENT)
        fetched = cuda.local.array(fetched_size, float32)  # the next key tile, loaded while this one is used
        scores = cuda.local.array(scores_size, float32)
        acc = cuda.local.array(acc_size, float32)
        row_max = cuda.local.array(THREAD_QUERIES, float32)
        row_sum = cuda.local.array(THREAD_QUERIES, float32)  # this thread's share of the weights' sum
        q_values = cuda.local.array(operand_size, float32)
        k_values = cuda.local.array(operand_size, float32)
        weights = cuda.local.array(operand_size, float32)
        values = cuda.local.array(dims, float32)
        for i in range(THREAD_QUERIES):
            row_max[i] = _NEG
            row_sum[i] = _ZERO
        for e in range(acc_size):
            acc[e] = _ZERO

        # The first key tile's keys, then Q; past the image: zeros.
        fetch_rows(qkv, fetched, 0, width + column, num_patches, row_stride, tid)
        for r in range(q_rounds):
            g = r * threads + tid
            if g < q_loads:
                x0 = x1 = x2 = x3 = _ZERO
                query = first_query + g // vectors
                if query < num_patches:
                    x0, x1, x2, x3 = load_f32x4(qkv, query * row_stride + column + 4 * (g % vectors))
                store_shared_f32x4(qs, (g // vectors) * q_pitch + 4 * (g % vectors), x0, x1, x2, x3)

        tile_start = 0
        while tile_start < num_patches:
            # K's last readers (the last tile's scores) passed the barrier before its P V
            stage_rows(kv, fetched, 0, tid)  # this tile's K
            fetch_rows(qkv, fetched, tile_start, 2 * width + column, num_patches, row_stride, tid)  # and V
            cuda.syncthreads()  # K (and Q) staged; every thread is past the last tile's P V

            # Scores of this thread's 4 queries x keys lane + 8j (q carries hd^-1/2).
            for e in range(scores_size):
                scores[e] = _ZERO
            for d in range(0, head_dim, 4 * unroll):  # written out `unroll` times: constant shared offsets
                score_round(qs, kv, q_values, k_values, scores, q_row, k_row, d)
                score_round(qs, kv, q_values, k_values, scores, q_row, k_row, d + 4)
                if unroll == 3:
                    score_round(qs, kv, q_values, k_values, scores, q_row, k_row, d + 8)

            stage_rows(kv, fetched, v_base, tid)  # V's readers (the last tile's P V) are done

            # Online softmax per query, on exp2; keys past the image score "none" and weigh 0.
            keys_left = num_patches - tile_start
            for i in range(THREAD_QUERIES):
                tile_max = _NEG
                for j in range(THREAD_KEYS):
                    s = scores[THREAD_KEYS * i + j]
                    if lane + LANES * j >= keys_left:
                        s = _NEG
                    scores[THREAD_KEYS * i + j] = s
                    tile_max = max(tile_max, s)
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 1))  # every thread, uniformly
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 2))
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 4))
                new_max = max(row_max[i], tile_max)  # a key of the tile is in the image: finite
                correction = float32(math.exp2((row_max[i] - new_max) * _LOG2E))  # 0 before the first tile
                row_max[i] = new_max
                shift = -new_max * _LOG2E  # exp(s - max) = 2^(s log2 e - max log2 e), the product exact in the FMA
                total = _ZERO
                p_row = (qg + query_groups * i) * p_pitch + lane
                for j in range(THREAD_KEYS):
                    weight = float32(math.exp2(cuda.fma(scores[THREAD_KEYS * i + j], _LOG2E, shift)))
                    ps[p_row + LANES * j] = weight
                    total += weight
                row_sum[i] = row_sum[i] * correction + total
                for k in range(dims):
                    acc[dims * i + k] *= correction
            next_start = tile_start + TILE_KEYS
            fetch_rows(qkv, fetched, next_start, width + column, num_patches, row_stride, tid)  # the next K
            cuda.syncthreads()

            # O += P V: this thread's 4 queries x its dims, over the keys of its half (V rows past the image
            # are zeros, their weights 0).
            for j in range(THREAD_KEYS):
                k4 = LANES * j + DIM_LANES * half
                for i in range(THREAD_QUERIES):
                    source = (qg + query_groups * i) * p_pitch + k4
                    weights[4 * i], weights[4 * i + 1], weights[4 * i + 2], weights[4 * i + 3] = load_shared_f32x4(
                        ps, source
                    )
                for e in range(4):
                    value_row = (TILE_KEYS + k4 + e) * kv_pitch
                    for m in range(quads):
                        values[4 * m], values[4 * m + 1], values[4 * m + 2], values[4 * m + 3] = load_shared_f32x4(
                            kv, value_row + 4 * (dim_lane + DIM_LANES * m)
                        )
                    if pair:
                        # Unsigned: Numba tests every signed shared index for a negative wrap-around.
                        value = uint64(value_row + pair_column + 2 * dim_lane)
                        values[4 * quads] = kv[value]
                        values[4 * quads + 1] = kv[value + uint64(1)]
                    for i in range(THREAD_QUERIES):
                        weight = weights[4 * i + e]
                        for k in range(dims):
                            acc[dims * i + k] = cuda.fma(weight, values[k], acc[dims * i + k])
            tile_start = next_start

        # The two key halves' sums meet (lanes xor 4); each half writes half of the dims.
        for i in range(THREAD_QUERIES):
            total = row_sum[i]
            total += shfl_xor_f32(total, 1)  # every thread, uniformly
            total += shfl_xor_f32(total, 2)
            total += shfl_xor_f32(total, 4)
            for k in range(dims):
                acc[dims * i + k] += shfl_xor_f32(acc[dims * i + k], DIM_LANES)
            query = first_query + qg + query_groups * i
            if query < num_patches:
                inverse = _ONE / total
                for m in range(quads):
                    if m % 2 == half:
                        base = column + 4 * (dim_lane + DIM_LANES * m)
                        for e in range(4):
                            out[query, base + e] = acc[dims * i + 4 * m + e] * inverse
                if pair and half == quads % 2:
                    base = column + pair_column + 2 * dim_lane
                    out[query, base] = acc[dims * i + 4 * quads] * inverse
                    out[query, base + 1] = acc[dims * i + 4 * quads + 1] * inverse

    name = f"vision_attention_d{head_dim}_w{warps}"
    vision_attention.__name__ = vision_attention.__qualname__ = name
    return kernel(ATTENTION_SIGNATURE, launch_bounds=(threads, max(1, 8 // warps)))(vision_attention)


RELEASED_HEAD_DIM = 72
"""Qwen3.5's vision tower: width 1152, 16 heads."""
if not SIMULATOR:  # registered now so the PTX and SASS checks see them; other shapes register on first use
    attention_kernel(RELEASED_HEAD_DIM, GPU_ATTENTION.warps)


def attention_tiling_for(head_dim: int, preferred: AttentionTiling) -> AttentionTiling:
    """`preferred`, or fewer warps until the kernel's shared memory fits 48 KB."""
    warps = preferred.warps
    while warps > 1 and AttentionTiling(warps).shared_bytes(head_dim) > MAX_STATIC_SHARED:
        warps //= 2
    tiling = AttentionTiling(warps)
    if tiling.shared_bytes(head_dim) > MAX_STATIC_SHARED:
        raise ValueError(f"head size {head_dim} needs more than 48 KB of shared memory for vision attention")
    return tiling


def attention_fmas(patches: int, num_heads: int, head_dim: int) -> int:
    """FMAs of one attention launch: scores and P V, every query over every key of every head."""
    return 2 * patches * patches * num_heads * head_dim


# --- launchers ---------------------------------------------------------------------------------------------


def _check_threads(threads: int) -> None:
    if threads % WARP_SIZE or not 0 < threads <= MAX_BLOCK_THREADS:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE} up to {MAX_BLOCK_THREADS}, got {threads}")


def _rows(x: Any, name: str) -> tuple[int, int]:
    rows, width = check_array(x, name, np.float32, 2)
    if rows == 0 or width == 0:
        raise ValueError(f"{name} is empty")
    return rows, width


def _quantized_rows(x: Any, name: str) -> tuple[int, int]:
    rows, width = _rows(x, name)
    if width % QUANT_BLOCK:
        raise ValueError(f"{name} rows must be multiples of {QUANT_BLOCK} values, got {width}")
    return rows, width


def add_positions_launch(
    states: Any, patch_bias: Any, table: Any, grid: tuple[int, int, int], merge: int, *, threads: int = ROW_THREADS
) -> Launch:
    """states [N, width] += patch_bias [width] + the position table [side^2, width] resampled to `grid`
    (frames, rows, cols) at each patch (merge-group order)."""
    _check_threads(threads)
    patches, width = _rows(states, "states")
    check_array(patch_bias, "patch_bias", np.float32, 1, (width,))
    entries, _ = check_array(table, "position table", np.float32, 2)
    side = math.isqrt(entries)
    if side * side != entries or table.shape[1] != width:
        raise ValueError(f"position table must be [side^2, {width}], got {tuple(table.shape)}")
    frames, rows, cols = grid
    if patches != frames * rows * cols or rows % merge or cols % merge:
        raise ValueError(f"{patches} patches do not make a grid of {grid} in {merge}x{merge} groups")
    args = (states, patch_bias, table, np.int32(side), np.int32(rows), np.int32(cols), np.int32(merge))
    return Launch(vision_add_positions, (-(-width // threads), patches), threads, args)


def layer_norm_quantize_launch(
    x: Any,
    residual_bias: Any,
    weight: Any,
    bias: Any,
    eps: float,
    quants: Any,
    scales: Any,
    normalized: Any | None = None,
    *,
    threads: int = ROW_THREADS,
) -> Launch:
    """x [T, n] += residual_bias [n] (in place), then LayerNorm(x) * weight + bias quantised into quants uint32
    [T, n/4] and scales fp32 [T, n/32]; with `normalized` (fp32 [T, n]) the normalised rows are kept too."""
    _check_threads(threads)
    tokens, n = _quantized_rows(x, "x")
    for array, name in ((residual_bias, "residual_bias"), (weight, "weight"), (bias, "bias")):
        check_array(array, name, np.float32, 1, (n,))
    check_quantized(quants, scales, tokens, n)
    if normalized is None:
        dispatcher, normalized = vision_layer_norm_quantize, x  # never written by this variant
    else:
        dispatcher = vision_layer_norm_quantize_keep
        check_array(normalized, "normalized", np.float32, 2, (tokens, n))
    args = (x, residual_bias, weight, bias, np.float32(eps), quants, scales, normalized)
    return Launch(dispatcher, tokens, threads, args)


def bias_act_quantize_launch(
    x: Any, bias: Any, activation: str, quants: Any, scales: Any, *, threads: int = ROW_THREADS
) -> Launch:
    """Quantise activation(x + bias) for x fp32 [T, n], bias [n]: "gelu_tanh", "gelu_erf" or "none"."""
    _check_threads(threads)
    tokens, n = _quantized_rows(x, "x")
    check_array(bias, "bias", np.float32, 1, (n,))
    check_quantized(quants, scales, tokens, n)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    words = n // VALUES_PER_WORD
    args = (x, bias, np.int32(ACTIVATIONS[activation]), quants, scales)
    return Launch(vision_bias_act_quantize, (-(-words // threads), tokens), threads, args)


def add_bias_launch(x: Any, bias: Any, *, threads: int = ROW_THREADS) -> Launch:
    """x [T, n] += bias [n], in place."""
    _check_threads(threads)
    tokens, n = _rows(x, "x")
    check_array(bias, "bias", np.float32, 1, (n,))
    return Launch(vision_add_bias, (-(-n // threads), tokens), threads, (x, bias))


def rotary_launch(
    qkv: Any,
    bias: Any,
    inv_freq: Any,
    grid: tuple[int, int, int],
    merge: int,
    num_heads: int,
    *,
    threads: int = ROW_THREADS,
) -> Launch:
    """In place on qkv fp32 [N, 3 * width]: + bias [3 * width]; q and k rotated by each patch's angles
    (inv_freq fp32 [head_dim / 4]); q scaled by head_dim^-1/2."""
    _check_threads(threads)
    patches, columns = _rows(qkv, "qkv")
    width = columns // 3
    if columns % 3 or width % num_heads or (width // num_heads) % 4:
        raise ValueError(f"qkv rows of {columns} are not q|k|v of {num_heads} heads of a multiple of 4")
    head_dim = width // num_heads
    check_array(bias, "qkv bias", np.float32, 1, (columns,))
    check_array(inv_freq, "inv_freq", np.float32, 1, (head_dim // 4,))
    frames, rows, cols = grid
    if patches != frames * rows * cols or rows % merge or cols % merge:
        raise ValueError(f"{patches} patches do not make a grid of {grid} in {merge}x{merge} groups")
    args = (qkv, bias, inv_freq, np.int32(rows), np.int32(cols), np.int32(merge), np.int32(num_heads),
            np.float32(head_dim**-0.5))  # fmt: skip
    return Launch(vision_rotary, patches, threads, args)


def attention_launch(qkv: Any, out: Any, num_heads: int, tiling: AttentionTiling = GPU_ATTENTION) -> Launch:
    """out fp32 [N, width] = softmax(q k^T) v per head, every patch over all N, for qkv fp32 [N, 3 * width]
    as `vision_rotary` leaves it (q scaled, q and k rotated, biases in). C-contiguous, 16-byte aligned."""
    patches, columns = _rows(qkv, "qkv")
    width = columns // 3
    if columns % 3 or width % num_heads or (width // num_heads) % LANES:
        raise ValueError(f"qkv rows of {columns} are not q|k|v of {num_heads} heads of a multiple of {LANES}")
    check_array(out, "out", np.float32, 2, (patches, width))
    head_dim = width // num_heads
    tiling = attention_tiling_for(head_dim, tiling)
    check_aligned(qkv, "qkv")
    dispatcher = attention_kernel(head_dim, tiling.warps)
    grid = (-(-patches // tiling.tile_queries), num_heads)
    return Launch(dispatcher, grid, tiling.threads, (qkv.reshape(-1), out, np.int32(patches)))
