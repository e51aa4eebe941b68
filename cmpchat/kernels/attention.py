"""Decode attention over the fp16 KV cache: split-K ("flash-decoding") partials, then a combine with the gate.

One new query token per sequence, a batch of sequences each with its own cache and length. Everything that
changes per token is read from device memory, so a captured CUDA graph replays unchanged:

- `decode_positions` int32 [B, 4], per batch row: (cache_index, t, h, w). cache_index is where the new token's
  K/V go (= tokens already cached); the attention length is cache_index + 1. (t, h, w) are the IMROPE
  positions, which differ from cache_index once images are in the context. A row whose cache_index is
  negative or past the row's capacity is inactive: nothing is written to its cache and its output is 0,
  so a graph captured for B rows can run fewer sequences.
- `page_table` int32 [B, pages_per_row]: the cache pages of each row, in token order.

KV cache layout, per attention layer (K and V separate, same shape, fp16, C-contiguous):
    [num_pages, page_tokens, Hkv, head_dim],   token j of row b at page page_table[b, j // page_tokens],
                                                slot j % page_tokens.
One page per sequence slot (page_tokens = max_context, page_table[b, 0] = slot) is the plain per-slot cache;
smaller pages let sequences of different lengths share one pool. The page table serves every layer.
Token-major rows keep each token's K (or V) for one head as one contiguous 512-byte run (hd 256), which is
four full 128-byte lines: reads are fully coalesced whatever the page size. Head-major pages would give a
decode read the same 512-byte runs and only scatter each token's write over Hkv places. page_tokens must be
a multiple of the kernel's tile (`DecodeAttentionConfig.tile_tokens`: 16 for hd 256 by default).

Tiling (`attention_partial`, one block of `warps` warps per (KV head, split, row), in that grid order):
- The block's G = H/Hkv query heads share every K/V load (GQA). A lane owns one 16-byte chunk (8 halves) of
  a row: hd/8 lanes read one row, a warp reads 32/(hd/8) rows side by side (1 for hd 256) and `unroll` such
  steps at once, K and V loads issued together (hd 256, unroll 4: 128 bytes in flight per lane).
- Scores: 8 fp32 FMAs per lane and head, then a butterfly over the hd/8 lanes of a row. Each (warp, row
  slot) runs its own online softmax in fp32 over disjoint tokens, with no barrier in the loop; the
  accumulator is rescaled only when the running max moves (uniform over the row's lanes, rare).
- The streams merge once, through shared memory (streams*G*hd floats = warps*G*256 for any hd), and the
  block writes one unnormalised partial (acc, max, sum) per query head.
- Splits: each row's length is cut into `num_splits` pieces (at least `min_split_tokens`, whole tiles), so
  short rows use few blocks and long ones the whole GPU. The split count is fixed when a graph is captured;
  the piece size follows the length read on the device. `splits_for` sizes it from the SM count and the
  blocks per SM wanted (the device's choice for G, `DeviceTuning.decode_attention_config`).
Bytes: per token and KV head 2*hd*2 bytes of cache; partials add G*(hd+2)*4 bytes per block, written and
read back (see `min_split_tokens`).

`attention_combine` (one block of 8 warps per (query head, row, 32 dims)) merges the splits with weights
exp(m_s - max), the warps taking every 8th split, and multiplies by sigmoid(gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, int64, uint32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    WARP_SIZE,
    allow_dependent_grids,
    load_u32x4,
    shfl_xor_f32,
    unpack_f16x2,
    wait_for_prior_grids,
    warp_max_f32,
    warp_sum_f32,
)
from cmpchat.cudart.launch import Launch, check_array

POSITION_COLUMNS = 4  # (cache_index, t, h, w)
MAX_SPLITS = 1024
MAX_GROUP = 8  # query heads per KV head held in registers
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # one 16-byte chunk per lane, a row within one warp
_NEG = float32(-1e30)  # "no score yet"; finite so that differences never make NaN

# --- device helpers shared by both kernels ---------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def split_tokens(length, num_splits, min_split_tokens, tile):
    """Tokens per split for a row of `length`: an equal share, at least the minimum, in whole tiles."""
    share = max((length + num_splits - 1) // num_splits, min_split_tokens)
    return (share + tile - 1) // tile * tile


@cuda.jit(device=True, inline=True)
def _row_sum(value, lanes_per_row):
    """Butterfly sum over the lanes_per_row neighbouring lanes that read one row; all of them get it."""
    offset = lanes_per_row // 2
    while offset > 0:
        value += shfl_xor_f32(value, offset)
        offset //= 2
    return value


# --- kernels ---------------------------------------------------------------------------------------------

_PARTIAL_SIGNATURE = (
    "void(float32[:, :, ::1], int32[:, ::1], int32[:, ::1], uint32[::1], uint32[::1], int32, int32, int32, "
    "float32[:, :, :, ::1], float32[:, :, :, ::1])"
)


@cache
def _partial_kernel(group: int, head_dim: int, warps: int, unroll: int) -> Any:
    """The split-K kernel specialised for G, hd and the tiling (register arrays need constant sizes)."""
    lanes_per_row = head_dim // 8
    slots = WARP_SIZE // lanes_per_row  # rows a warp reads side by side
    tile = warps * slots * unroll
    words_per_row = head_dim // 2
    scale = float32(head_dim**-0.5)
    # Array sizes must be plain constants when Numba types the kernel.
    lane_values, step_scores, step_words = group * 8, unroll * group, unroll * 4
    streams = warps * slots  # independent online softmaxes, merged once through shared memory
    shared_values, shared_heads = streams * group * head_dim, streams * group

    def attention_partial(
        q, positions, page_table, k_words, v_words, num_kv_heads, page_tokens, min_split_tokens, partial_acc, partial_ml
    ):
        wait_for_prior_grids()
        allow_dependent_grids()
        kv_head, split, row = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        thread = cuda.threadIdx.x
        lane, warp = thread % WARP_SIZE, thread // WARP_SIZE
        slot, chunk = lane // lanes_per_row, lane % lanes_per_row
        cache_index = positions[row, 0]
        if cache_index < 0 or cache_index >= page_table.shape[1] * page_tokens:
            return
        length = cache_index + 1
        per_split = split_tokens(length, partial_acc.shape[2], min_split_tokens, tile)
        start = split * per_split
        if start >= length:
            return  # whole block: the barriers below stay uniform
        stop = min(start + per_split, length)

        query = cuda.local.array(lane_values, float32)  # this lane's 8 dims of each head, times hd^-1/2
        acc = cuda.local.array(lane_values, float32)
        running_max = cuda.local.array(group, float32)
        running_sum = cuda.local.array(group, float32)
        scores = cuda.local.array(step_scores, float32)
        k_raw = cuda.local.array(step_words, uint32)
        v_raw = cuda.local.array(step_words, uint32)
        for g in range(group):
            running_max[g] = _NEG
            running_sum[g] = float32(0)
            for i in range(8):
                query[g * 8 + i] = q[row, kv_head * group + g, chunk * 8 + i] * scale
                acc[g * 8 + i] = float32(0)

        page_slot = start // page_tokens
        page_offset = start - page_slot * page_tokens  # tiles never straddle pages
        for tile_start in range(start, stop, tile):
            page = int64(page_table[row, page_slot])
            for u in range(unroll):
                token = (warp * unroll + u) * slots + slot
                if tile_start + token < stop:
                    cache_row = (page * page_tokens + page_offset + token) * num_kv_heads + kv_head
                    word = cache_row * words_per_row + chunk * 4
                    k_raw[4 * u], k_raw[4 * u + 1], k_raw[4 * u + 2], k_raw[4 * u + 3] = load_u32x4(k_words, word)
                    v_raw[4 * u], v_raw[4 * u + 1], v_raw[4 * u + 2], v_raw[4 * u + 3] = load_u32x4(v_words, word)
                else:
                    for w in range(4):
                        k_raw[4 * u + w] = uint32(0)
                        v_raw[4 * u + w] = uint32(0)
            for u in range(unroll):
                for g in range(group):
                    scores[u * group + g] = float32(0)
                for w in range(4):
                    low, high = unpack_f16x2(k_raw[4 * u + w])
                    for g in range(group):
                        dot = scores[u * group + g] + query[g * 8 + 2 * w] * low
                        scores[u * group + g] = dot + query[g * 8 + 2 * w + 1] * high
            for j in range(step_scores):  # all lanes, uniform: the simulator's shuffles need that
                scores[j] = _row_sum(scores[j], lanes_per_row)

            for g in range(group):
                tile_max = _NEG  # over real tokens only: a padding score of 0 could underflow every weight
                for u in range(unroll):
                    if tile_start + (warp * unroll + u) * slots + slot < stop:
                        tile_max = max(tile_max, scores[u * group + g])
                new_max = max(running_max[g], tile_max)
                correction = math.exp(running_max[g] - new_max)
                running_max[g] = new_max
                if correction != float32(1):  # rare after the first tokens; uniform over a row's lanes
                    running_sum[g] *= correction
                    for i in range(8):
                        acc[g * 8 + i] *= correction
                for u in range(unroll):
                    token = (warp * unroll + u) * slots + slot
                    weight = float32(0)
                    if tile_start + token < stop:
                        weight = math.exp(scores[u * group + g] - new_max)
                    scores[u * group + g] = weight
                    running_sum[g] += weight
            for u in range(unroll):
                for w in range(4):
                    low, high = unpack_f16x2(v_raw[4 * u + w])
                    for g in range(group):
                        acc[g * 8 + 2 * w] += scores[u * group + g] * low
                        acc[g * 8 + 2 * w + 1] += scores[u * group + g] * high

            page_offset += tile
            if page_offset == page_tokens:
                page_offset = 0
                page_slot += 1

        shared_acc = cuda.shared.array(shared_values, float32)
        shared_max = cuda.shared.array(shared_heads, float32)
        shared_sum = cuda.shared.array(shared_heads, float32)
        stream = warp * slots + slot
        for g in range(group):
            for i in range(8):
                shared_acc[(stream * group + g) * head_dim + chunk * 8 + i] = acc[g * 8 + i]
            if chunk == 0:
                shared_max[stream * group + g] = running_max[g]
                shared_sum[stream * group + g] = running_sum[g]
        cuda.syncthreads()
        for index in range(thread, group * head_dim, warps * WARP_SIZE):
            g, dim = index // head_dim, index % head_dim
            top = _NEG
            for other in range(streams):
                top = max(top, shared_max[other * group + g])
            total = float32(0)
            weights = float32(0)
            for other in range(streams):
                weight = math.exp(shared_max[other * group + g] - top)  # 0 for a stream that saw no token
                total += weight * shared_acc[(other * group + g) * head_dim + dim]
                weights += weight * shared_sum[other * group + g]
            head = kv_head * group + g
            partial_acc[row, head, split, dim] = total
            if dim == 0:
                partial_ml[row, head, split, 0] = top
                partial_ml[row, head, split, 1] = weights

    name = f"attention_partial_g{group}_d{head_dim}_w{warps}_u{unroll}"
    attention_partial.__name__ = attention_partial.__qualname__ = name
    return kernel(_PARTIAL_SIGNATURE, early_launch=True)(attention_partial)


# The released Qwen3.5 sizes have G = 4 (0.8B-9B) or 6 (27B) and hd 256: registered now so the PTX and SASS
# checks see them; other shapes (the tests' tiny ones) register on first use.
for _group in (4, 6):
    _partial_kernel(_group, 256, 4, 4)


COMBINE_WARPS = 8
"""Warps of a combine block: each sums every 8th split of the block's 32 dims, so a row's up to MAX_SPLITS
partials are read with 8 loads in flight per dim instead of one after another."""
COMBINE_THREADS = COMBINE_WARPS * WARP_SIZE


@kernel(
    "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, ::1], int32[:, ::1], int32, int32, int32, "
    "float32[:, ::1])"
)
def attention_combine(partial_acc, partial_ml, qkv, positions, capacity, tile, min_split_tokens, out):
    """out[row, head, 32 dims] = the splits' partials merged (weights exp(m_s - max)), normalised, times
    sigmoid(gate). One block per (head, row, 32 dims), its warps each taking every COMBINE_WARPS-th split: one
    thread per dim looping over all the splits (264 then) made this 30-90 µs a layer at 4K-32K tokens (H200).
    Not an early launch: launched early (with the kernel after it) it made decode steps 0.02-0.04 ms slower at
    4K-32K tokens and no faster at 0 (H200, 9B and 27B), the one decode kernel that did not gain."""
    head, row = cuda.blockIdx.x, cuda.blockIdx.y
    thread = cuda.threadIdx.x
    lane, warp = thread % WARP_SIZE, thread // WARP_SIZE
    head_dim = partial_acc.shape[3]
    dim = cuda.blockIdx.z * WARP_SIZE + lane
    cache_index = positions[row, 0]
    if cache_index < 0 or cache_index >= capacity:
        if warp == 0:
            out[row, head * head_dim + dim] = float32(0)
        return
    length = cache_index + 1
    per_split = split_tokens(length, partial_acc.shape[2], min_split_tokens, tile)
    active = (length + per_split - 1) // per_split  # the splits the partial kernel wrote

    # Every warp finds the max and the normaliser itself (warp sums, no barrier: about 1 µs less at short
    # contexts than block-wide reductions), then sums every COMBINE_WARPS-th split of its 32 dims.
    top = _NEG
    for s in range(lane, active, WARP_SIZE):
        top = max(top, partial_ml[row, head, s, 0])
    top = warp_max_f32(top)
    norm = float32(0)
    for s in range(lane, active, WARP_SIZE):
        norm += math.exp(partial_ml[row, head, s, 0] - top) * partial_ml[row, head, s, 1]
    norm = warp_sum_f32(norm)
    total = float32(0)
    s = warp
    while s + 3 * COMBINE_WARPS < active:  # four independent loads before their sums
        a0 = partial_acc[row, head, s, dim]
        a1 = partial_acc[row, head, s + COMBINE_WARPS, dim]
        a2 = partial_acc[row, head, s + 2 * COMBINE_WARPS, dim]
        a3 = partial_acc[row, head, s + 3 * COMBINE_WARPS, dim]
        total += math.exp(partial_ml[row, head, s, 0] - top) * a0
        total += math.exp(partial_ml[row, head, s + COMBINE_WARPS, 0] - top) * a1
        total += math.exp(partial_ml[row, head, s + 2 * COMBINE_WARPS, 0] - top) * a2
        total += math.exp(partial_ml[row, head, s + 3 * COMBINE_WARPS, 0] - top) * a3
        s += 4 * COMBINE_WARPS
    while s < active:
        total += math.exp(partial_ml[row, head, s, 0] - top) * partial_acc[row, head, s, dim]
        s += COMBINE_WARPS
    sums = cuda.shared.array(COMBINE_THREADS, float32)
    sums[thread] = total
    cuda.syncthreads()
    if warp == 0:
        for other in range(1, COMBINE_WARPS):
            total += sums[other * WARP_SIZE + lane]
        gate = qkv[row, (2 * head + 1) * head_dim + dim]
        out[row, head * head_dim + dim] = total / norm / (float32(1) + math.exp(-gate))


@cuda.jit(device=True, inline=True)
def merge_splits(partial_acc, partial_ml, row, head, dim, active):
    """Dim `dim` of (row, head)'s attention: its first `active` split partials merged with weights
    exp(m_s - max), normalised. One thread per dim, the splits one after another: prefill's combine, whose
    many rows fill the GPU."""
    top = _NEG
    for s in range(active):
        top = max(top, partial_ml[row, head, s, 0])
    total = float32(0)
    norm = float32(0)
    for s in range(active):
        weight = math.exp(partial_ml[row, head, s, 0] - top)
        total += weight * partial_acc[row, head, s, dim]
        norm += weight * partial_ml[row, head, s, 1]
    return total / norm


@cuda.jit(device=True, inline=True)
def gated(attended, qkv, row, head, dim, head_dim):
    """`attended` (dim `dim` of head `head`'s attention) times sigmoid(gate), the gate read from the fused
    projection output."""
    gate = qkv[row, (2 * head + 1) * head_dim + dim]
    return attended / (float32(1) + math.exp(-gate))


# --- launchers -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeAttentionConfig:
    """How decode attention is cut up; fixed for a captured graph (the lengths are not)."""

    num_splits: int
    """Split-K blocks per (row, KV head); `splits_for` picks one that fills the GPU."""
    min_split_tokens: int = 32
    """A split reads at least this many tokens (rounded up to whole tiles). Short contexts are latency-bound
    (a split's tiles run one after another), so this stays small; partials then add ~12% to the cache read
    at 4K tokens and under 4% from 16K up."""
    warps: int = 4
    unroll: int = 4
    """Rows each lane loads per step (bytes in flight vs registers)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {self.num_splits}")
        if self.min_split_tokens < 1 or self.warps < 1 or self.warps * WARP_SIZE > 1024 or self.unroll < 1:
            raise ValueError(f"invalid decode attention config {self}")

    def tile_tokens(self, head_dim: int) -> int:
        """Tokens one block step reads; page_tokens must be a multiple of it."""
        return self.warps * (WARP_SIZE // (head_dim // 8)) * self.unroll

    @classmethod
    def splits_for(
        cls, batch: int, num_kv_heads: int, sm_count: int, blocks_per_sm: int, **tiling: Any
    ) -> DecodeAttentionConfig:
        """Enough splits that a batch of long rows gives every SM `blocks_per_sm` blocks (the device's choice
        per G: `DeviceTuning.decode_attention_config`), with the tiling's other fields `tiling`."""
        wanted = math.ceil(sm_count * blocks_per_sm / (batch * num_kv_heads))
        return cls(num_splits=max(1, min(MAX_SPLITS, wanted)), **tiling)


def partial_buffer_shapes(
    batch: int, num_heads: int, head_dim: int, config: DecodeAttentionConfig
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 scratch the backend allocates once: partial_acc and partial_ml (max, sum)."""
    return (batch, num_heads, config.num_splits, head_dim), (batch, num_heads, config.num_splits, 2)


def decode_attention(
    q: Any,
    qkv: Any,
    decode_positions: Any,
    page_table: Any,
    k_cache: Any,
    v_cache: Any,
    partial_acc: Any,
    partial_ml: Any,
    out: Any,
    config: DecodeAttentionConfig,
) -> tuple[Launch, Launch]:
    """The two launches of one decode-attention step for an attention layer (run them in order).

    q: fp32 [B, H, hd] from `qk_norm_rope`. qkv: the fused projection output [B, 2*H*hd + 2*Hkv*hd] (the
    gate of head h is qkv[:, (2h+1)*hd : (2h+2)*hd]). k_cache/v_cache: fp16 [pages, page_tokens, Hkv, hd]
    holding this step's token already. out: fp32 [B, H*hd] = attention * sigmoid(gate).
    """
    batch, num_heads, head_dim = check_array(q, "q", np.float32, 3)
    _, _, num_kv_heads, _ = check_kv_cache(k_cache, v_cache, head_dim)
    page_tokens = k_cache.shape[1]
    check_row_inputs(decode_positions, page_table, batch)
    check_array(qkv, "qkv", np.float32, 2, (batch, 2 * (num_heads + num_kv_heads) * head_dim))
    acc_shape, ml_shape = partial_buffer_shapes(batch, num_heads, head_dim, config)
    check_array(partial_acc, "partial_acc", np.float32, 4, acc_shape)
    check_array(partial_ml, "partial_ml", np.float32, 4, ml_shape)
    check_array(out, "out", np.float32, 2, (batch, num_heads * head_dim))
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads: need a group of 1..{MAX_GROUP}")
    tile = config.tile_tokens(head_dim)
    if page_tokens % tile:
        raise ValueError(f"page_tokens {page_tokens} is not a multiple of the {tile}-token attention tile")
    min_split = -(-config.min_split_tokens // tile) * tile
    group = num_heads // num_kv_heads
    sizes = (np.int32(num_kv_heads), np.int32(page_tokens), np.int32(min_split))
    partial = Launch(
        _partial_kernel(group, head_dim, config.warps, config.unroll),
        (num_kv_heads, config.num_splits, batch),  # live splits first: at short contexts they start in the first wave
        config.warps * WARP_SIZE,
        (q, decode_positions, page_table, _words(k_cache), _words(v_cache), *sizes, partial_acc, partial_ml),
    )
    capacity = np.int32(page_table.shape[1] * page_tokens)
    combine = Launch(
        attention_combine,
        (num_heads, batch, head_dim // WARP_SIZE),
        COMBINE_THREADS,
        (partial_acc, partial_ml, qkv, decode_positions, capacity, np.int32(tile), np.int32(min_split), out),
    )
    return partial, combine


# --- argument checks (shared with qk_norm_rope) ----------------------------------------------------------


def check_kv_cache(k_cache: Any, v_cache: Any, head_dim: int) -> tuple[int, ...]:
    """Both caches fp16 [pages, page_tokens, Hkv, hd] of one shape; that shape."""
    shape = check_array(k_cache, "k_cache", np.float16, 4)
    check_array(v_cache, "v_cache", np.float16, 4, shape)
    if shape[3] != head_dim or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"KV cache head size {shape[3]} with query head size {head_dim}; need one of {SUPPORTED_HEAD_DIMS}"
        )
    return shape


def check_row_inputs(decode_positions: Any, page_table: Any, batch: int) -> None:
    check_array(decode_positions, "decode_positions", np.int32, 2, (batch, POSITION_COLUMNS))
    rows, _ = check_array(page_table, "page_table", np.int32, 2)
    if rows != batch:
        raise ValueError(f"page_table has {rows} rows for a batch of {batch}")


def _words(cache: Any) -> Any:
    """The fp16 cache as flat uint32 words, for 16-byte loads (two halves per word, low half first)."""
    return cache.reshape(-1).view(np.uint32)
