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
- `vision_attention_*`: bidirectional softmax attention of every patch of one image over all of its patches,
  one head per blockIdx.y: FlashAttention-style in fp32 FMAs (no tensor cores: docs/hardware.md), below.

Quantisation is `quantize.py`'s (`quantize_word`, `block_amax`: the same bits as `quantize_activations`).
Patch coordinates follow `encoder.patch_coordinates`: patches arrive in merge-group order, each 2x2 group of
the grid four consecutive rows, frames one after another.

Attention tiling (`AttentionTiling`; GPU values in brackets, hd = 72 in the released encoders):
- A block is [16] query groups x 8 key groups of threads ([128]); it owns TQ x [16] = [64] queries of one
  head and walks the image's keys in tiles of 8 x TK = 32 (TQ = TK = 4). Thread (qg, kg) owns queries
  qg + QG*i (i < 4) and, of each key tile, keys kg + 8j (j < 4) for the scores and head dims kg + 8k
  (k < hd/8) for the output: 16 scores and 4 x hd/8 [36] output accumulators in registers.
- Shared memory (static, fp32): Q [64 x (hd + 4)], the key tile's K and V [2 x 32 x (hd + 4)] and its
  weights P [64 x 36]: [48,128 bytes] at hd 72 (the launcher takes fewer query groups when a larger hd would
  pass 48 KB). Row pitches are odd multiples of 4 words, so a quarter-warp's 16-byte loads of 8 distinct
  rows hit 8 distinct bank quads.
- Per key tile: stage K and V (every thread issues its 16-byte global loads before it stores any; keys past
  the image are zeros), sync; scores: per 4 head dims 4 + 4 16-byte shared loads and 64 FMAs; online softmax
  per query (the tile max over the 8 lanes of a query group by 3 shuffles; weights exp(s - max), 0 for keys
  past the image; the running sums and accumulators rescaled when the max moves), weights to P, sync;
  P V: per 4 keys 4 16-byte loads of P and per key hd/8 loads of V for 4 x hd/8 FMAs; sync.
- Work: 2 x N^2 x hd FMAs per head; per SM and key tile ~2,300 FMAs a thread against ~460 shared loads, so
  the FFMA pipe, not shared memory, sets the pace on sm_70 (64 FFMA lanes, 32 shared-memory banks an SM).
  Query tiles are blockIdx.x: the blocks running together share a head, whose K and V (N x hd x 8 bytes,
  2 MB at 3520 patches) stay in L2.
The simulator runs one Python thread per CUDA thread: its tiling has 4 query groups (32 threads, 16 queries).
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

KEY_GROUPS = 8
THREAD_QUERIES = 4
THREAD_KEYS = 4
TILE_KEYS = KEY_GROUPS * THREAD_KEYS


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    query_groups: int
    """Thread rows of a block; it owns 4 x query_groups queries (threads: query_groups x 8)."""

    @property
    def threads(self) -> int:
        return self.query_groups * KEY_GROUPS

    @property
    def tile_queries(self) -> int:
        return self.query_groups * THREAD_QUERIES

    def shared_bytes(self, head_dim: int) -> int:
        pitch = head_dim + 4
        return 4 * (self.tile_queries * pitch + 2 * TILE_KEYS * pitch + self.tile_queries * (TILE_KEYS + 4))


GPU_ATTENTION = AttentionTiling(query_groups=16)
"""64 queries, 128 threads, two blocks an SM at hd 72 (48,128 bytes of shared memory each)."""
SIMULATOR_ATTENTION = AttentionTiling(query_groups=4)
"""16 queries, one warp: the same body, small enough for one Python thread per CUDA thread."""
ATTENTION_SIGNATURE = "void(float32[::1], float32[:, ::1], int32)"


@cache
def attention_kernel(head_dim: int, query_groups: int) -> Any:
    """The attention kernel for a head size and tiling (register arrays need constant sizes), defined and
    registered on first use."""
    threads = query_groups * KEY_GROUPS
    tile_queries = query_groups * THREAD_QUERIES
    pitch = head_dim + 4  # an odd multiple of 4 words when hd is a multiple of 8
    p_pitch = TILE_KEYS + 4
    dims = head_dim // KEY_GROUPS  # output dims a thread owns
    vectors = head_dim // 4  # 16-byte groups of a head's row
    q_size = tile_queries * pitch
    kv_size = 2 * TILE_KEYS * pitch
    p_size = tile_queries * p_pitch
    q_loads, kv_loads = tile_queries * vectors, 2 * TILE_KEYS * vectors
    q_rounds, kv_rounds = -(-q_loads // threads), -(-kv_loads // threads)
    fetched_size = 4 * max(q_rounds, kv_rounds)
    scores_size = THREAD_QUERIES * THREAD_KEYS
    acc_size = THREAD_QUERIES * dims

    def vision_attention(qkv, out, num_patches):
        q_tile, head = cuda.blockIdx.x, cuda.blockIdx.y
        tid = cuda.threadIdx.x
        qg = tid // KEY_GROUPS
        kg = tid % KEY_GROUPS  # the 8 lanes of a query group are neighbours: shuffles xor 1, 2, 4
        width = out.shape[1]
        row_stride = 3 * width
        first_query = q_tile * tile_queries
        column = head * head_dim

        qs = cuda.shared.array(q_size, float32, alignment=SHARED_ALIGNMENT)
        kv = cuda.shared.array(kv_size, float32, alignment=SHARED_ALIGNMENT)  # K rows, then V rows
        ps = cuda.shared.array(p_size, float32, alignment=SHARED_ALIGNMENT)
        fetched = cuda.local.array(fetched_size, float32)
        scores = cuda.local.array(scores_size, float32)
        acc = cuda.local.array(acc_size, float32)
        row_max = cuda.local.array(THREAD_QUERIES, float32)
        row_sum = cuda.local.array(THREAD_QUERIES, float32)  # this thread's share of the weights' sum
        q_values = cuda.local.array(scores_size, float32)
        k_values = cuda.local.array(scores_size, float32)
        weights = cuda.local.array(scores_size, float32)
        values = cuda.local.array(dims, float32)
        for i in range(THREAD_QUERIES):
            row_max[i] = _NEG
            row_sum[i] = _ZERO
        for e in range(acc_size):
            acc[e] = _ZERO

        # Q tile: every load issued before any store; queries past the image are zeros.
        for r in range(q_rounds):
            g = r * threads + tid
            x0 = x1 = x2 = x3 = _ZERO
            if g < q_loads:
                query = first_query + g // vectors
                if query < num_patches:
                    x0, x1, x2, x3 = load_f32x4(qkv, query * row_stride + column + 4 * (g % vectors))
            fetched[4 * r], fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3] = x0, x1, x2, x3
        for r in range(q_rounds):
            g = r * threads + tid
            if g < q_loads:
                store_shared_f32x4(qs, (g // vectors) * pitch + 4 * (g % vectors), fetched[4 * r],
                                   fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3])  # fmt: skip

        tile_start = 0
        while tile_start < num_patches:
            cuda.syncthreads()  # the last tile's readers are done with kv and ps (and Q is staged)
            for r in range(kv_rounds):
                g = r * threads + tid
                x0 = x1 = x2 = x3 = _ZERO
                if g < kv_loads:
                    staged_row = g // vectors  # K rows 0..31, V rows 32..63
                    is_value = staged_row >= TILE_KEYS
                    key = tile_start + staged_row - (TILE_KEYS if is_value else 0)
                    if key < num_patches:
                        offset = (2 if is_value else 1) * width + column + 4 * (g % vectors)
                        x0, x1, x2, x3 = load_f32x4(qkv, key * row_stride + offset)
                fetched[4 * r], fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3] = x0, x1, x2, x3
            for r in range(kv_rounds):
                g = r * threads + tid
                if g < kv_loads:
                    store_shared_f32x4(kv, (g // vectors) * pitch + 4 * (g % vectors), fetched[4 * r],
                                       fetched[4 * r + 1], fetched[4 * r + 2], fetched[4 * r + 3])  # fmt: skip
            cuda.syncthreads()

            # Scores of this thread's 4 queries x 4 keys (q carries hd^-1/2).
            for e in range(scores_size):
                scores[e] = _ZERO
            for d in range(0, head_dim, 4):
                for i in range(THREAD_QUERIES):
                    source = (qg + query_groups * i) * pitch + d
                    q_values[4 * i], q_values[4 * i + 1], q_values[4 * i + 2], q_values[4 * i + 3] = load_shared_f32x4(
                        qs, source
                    )
                for j in range(THREAD_KEYS):
                    source = (kg + KEY_GROUPS * j) * pitch + d
                    k_values[4 * j], k_values[4 * j + 1], k_values[4 * j + 2], k_values[4 * j + 3] = load_shared_f32x4(
                        kv, source
                    )
                for i in range(THREAD_QUERIES):
                    for j in range(THREAD_KEYS):
                        s = scores[THREAD_KEYS * i + j]
                        for e in range(4):
                            s = cuda.fma(q_values[4 * i + e], k_values[4 * j + e], s)
                        scores[THREAD_KEYS * i + j] = s

            # Online softmax per query; the weights go to P.
            for i in range(THREAD_QUERIES):
                tile_max = _NEG  # over keys inside the image only
                for j in range(THREAD_KEYS):
                    if tile_start + kg + KEY_GROUPS * j < num_patches:
                        tile_max = max(tile_max, scores[THREAD_KEYS * i + j])
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 1))  # every thread, uniformly
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 2))
                tile_max = max(tile_max, shfl_xor_f32(tile_max, 4))
                new_max = max(row_max[i], tile_max)
                correction = float32(math.exp(row_max[i] - new_max))  # 0 before the first tile
                row_max[i] = new_max
                total = _ZERO
                for j in range(THREAD_KEYS):
                    weight = _ZERO
                    if tile_start + kg + KEY_GROUPS * j < num_patches:
                        weight = float32(math.exp(scores[THREAD_KEYS * i + j] - new_max))
                    ps[(qg + query_groups * i) * p_pitch + kg + KEY_GROUPS * j] = weight
                    total += weight
                row_sum[i] = row_sum[i] * correction + total
                for k in range(dims):
                    acc[dims * i + k] *= correction
            cuda.syncthreads()

            # O += P V over the tile's keys (V rows past the image are zeros, their weights 0).
            for k4 in range(0, TILE_KEYS, 4):
                for i in range(THREAD_QUERIES):
                    source = (qg + query_groups * i) * p_pitch + k4
                    weights[4 * i], weights[4 * i + 1], weights[4 * i + 2], weights[4 * i + 3] = load_shared_f32x4(
                        ps, source
                    )
                for e in range(4):
                    # Unsigned: Numba tests every signed shared index for a negative wrap-around.
                    value_row = uint64((TILE_KEYS + k4 + e) * pitch + kg)
                    for k in range(dims):
                        values[k] = kv[value_row + uint64(KEY_GROUPS * k)]
                    for i in range(THREAD_QUERIES):
                        weight = weights[4 * i + e]
                        for k in range(dims):
                            acc[dims * i + k] = cuda.fma(weight, values[k], acc[dims * i + k])
            tile_start += TILE_KEYS

        for i in range(THREAD_QUERIES):
            total = row_sum[i]
            total += shfl_xor_f32(total, 1)  # every thread, uniformly
            total += shfl_xor_f32(total, 2)
            total += shfl_xor_f32(total, 4)
            query = first_query + qg + query_groups * i
            if query < num_patches:
                inverse = _ONE / total
                for k in range(dims):
                    out[query, column + kg + KEY_GROUPS * k] = acc[dims * i + k] * inverse

    name = f"vision_attention_d{head_dim}_q{query_groups}"
    vision_attention.__name__ = vision_attention.__qualname__ = name
    return kernel(ATTENTION_SIGNATURE, launch_bounds=(threads, 2))(vision_attention)


RELEASED_HEAD_DIM = 72
"""Qwen3.5's vision tower: width 1152, 16 heads."""
if not SIMULATOR:  # registered now so the PTX and SASS checks see them; other shapes register on first use
    attention_kernel(RELEASED_HEAD_DIM, GPU_ATTENTION.query_groups)


def attention_tiling_for(head_dim: int, preferred: AttentionTiling) -> AttentionTiling:
    """`preferred`, or fewer query groups until the kernel's shared memory fits 48 KB."""
    groups = preferred.query_groups
    while groups > 1 and AttentionTiling(groups).shared_bytes(head_dim) > MAX_STATIC_SHARED:
        groups //= 2
    tiling = AttentionTiling(groups)
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
    if columns % 3 or width % num_heads or (width // num_heads) % KEY_GROUPS:
        raise ValueError(f"qkv rows of {columns} are not q|k|v of {num_heads} heads of a multiple of {KEY_GROUPS}")
    check_array(out, "out", np.float32, 2, (patches, width))
    head_dim = width // num_heads
    tiling = attention_tiling_for(head_dim, tiling)
    check_aligned(qkv, "qkv")
    dispatcher = attention_kernel(head_dim, tiling.query_groups)
    grid = (-(-patches // tiling.tile_queries), num_heads)
    return Launch(dispatcher, grid, tiling.threads, (qkv.reshape(-1), out, np.int32(patches)))
