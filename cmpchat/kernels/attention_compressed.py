"""Decode attention over a compressed KV cache (issue 29): split-K partials on the codes, then a combine with
the gate (and, for tq3 values, the inverse rotation).

The same split-K scheme, tiling (`DecodeAttentionConfig`), inputs and partial buffers as the fp16 kernel
(`attention.py`: its docstring says how rows, splits and the page table work), over the pages `kv_codes`
describes, written by `kv_write`. Per block (KV head, split, row), one lane owns 8 consecutive dims of a row:

- tq3 keys: the block's query heads are rotated once into the keys' domain (sign flip, then the Walsh-Hadamard
  butterflies: strides 1-4 in the lane's registers, 8-64 by warp shuffles over the lanes of one 128-block), in
  the reference's order, so the rotated query equals `kv_formats.rotate(q)`. Each token's codes come as the
  lane's 24 bits (`kv_codes.tq3_lane_bits`), each value is the codebook level (8 fp32 in shared memory,
  different levels in different banks) for a shift and a mask, and the lane's partial dot is times its block's
  scale before the butterfly over the row's lanes. q8 keys: 8 int8 codes from two words, times the fp16 scale
  of their 32 (dequantised in registers). Scores are fp32 FFMAs, no tensor cores.
- Values the same way, accumulated in their domain: weight times the token's scale times the level. tq3
  values leave the partials rotated; `attention_combine_unrotate` merges the splits for a whole 128-block,
  runs the inverse transform once per head output in shared memory (butterflies, 1/sqrt(128), sign flip) and
  then applies sigmoid(gate), so the gate multiplies the model-domain output as in the reference. q8 values
  use the fp16 path's `attention_combine`.

Bytes per token and KV head: tq3 208 (keys and values: 96 of codes and 8 of scales each), q8k-tq3v 376, q8
544, against fp16's 1024. The codes' loads are small (4-8 bytes a lane), so each tile keeps `unroll` tokens'
loads in flight per warp as the fp16 kernel does.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, int64, uint32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    WARP_SIZE,
    allow_dependent_grids,
    shfl_xor_f32,
    wait_for_prior_grids,
    warp_max_f32,
    warp_sum_f32,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.attention import (
    COMBINE_THREADS,
    MAX_GROUP,
    DecodeAttentionConfig,
    attention_combine,
    check_row_inputs,
    gated,
    partial_buffer_shapes,
    split_tokens,
)
from cmpchat.kernels.kv_codes import (
    GPU_FORMATS,
    INV_SQRT_BLOCK,
    LANE_VALUES,
    TQ3_BOOK,
    TQ3_CODES,
    TQ3_SIGNS,
    check_caches,
    q8_value,
    tq3_lane_bits,
)
from cmpchat.kv_formats import TQ3_BLOCK

_NEG = float32(-1e30)  # "no score yet", as attention.py
_BLOCK_CHUNKS = TQ3_BLOCK // LANE_VALUES  # lanes of one 128-block


@cuda.jit(device=True, inline=True)
def _row_sum(value, lanes_per_row):
    offset = lanes_per_row // 2
    while offset > 0:
        value += shfl_xor_f32(value, offset)
        offset //= 2
    return value


@cuda.jit(device=True, inline=True)
def _rotate_lane_values(values, count, chunk):
    """The unnormalised Walsh-Hadamard butterflies of each 128-block, on `count` values a lane holds as groups
    of 8 consecutive dims (chunk `chunk` of each): the reference's order, stride 1 first. Uniform: shuffles."""
    for base in range(0, count, LANE_VALUES):
        half = 1
        while half < LANE_VALUES:
            for i in range(LANE_VALUES):
                if i & half == 0:
                    a, b = values[base + i], values[base + i + half]
                    values[base + i], values[base + i + half] = a + b, a - b
            half *= 2
    mask = 1
    while mask < _BLOCK_CHUNKS:
        upper = chunk & mask != 0
        for j in range(count):
            partner = shfl_xor_f32(values[j], mask)
            values[j] = partner - values[j] if upper else values[j] + partner
        mask *= 2


@cuda.jit(device=True, inline=True)
def rotate_lane_queries(values, count, chunk):
    """`kv_formats.rotate` of the vectors whose dims 8 chunk .. 8 chunk + 7 a lane holds in `values` (groups of
    8, `count` in all): the sign flip, the butterflies, 1/sqrt(128). Uniform: shuffles."""
    for j in range(count):
        values[j] *= TQ3_SIGNS[(chunk * LANE_VALUES + j % LANE_VALUES) % TQ3_BLOCK]
    _rotate_lane_values(values, count, chunk)
    for j in range(count):
        values[j] *= INV_SQRT_BLOCK


@cuda.jit(device=True, inline=True)
def unrotate_block(rotated, base, i, writes):
    """Value i of `kv_formats.unrotate` of the 128-block at rotated[base:] (shared memory): the butterflies in
    place, 1/sqrt(128), the sign flip. Every thread of the block calls it (barriers); those with `writes`
    (one per value i) update the block."""
    half = 1
    while half < TQ3_BLOCK:
        mine, partner = rotated[base + i], rotated[base + (i ^ half)]
        cuda.syncthreads()
        if writes:
            rotated[base + i] = mine + partner if i & half == 0 else partner - mine
        cuda.syncthreads()
        half *= 2
    return rotated[base + i] * INV_SQRT_BLOCK * TQ3_SIGNS[i]


def _signature(format_name: str) -> str:
    key, value = GPU_FORMATS[format_name]
    k_scale, v_scale = np.dtype(key.scale_dtype).name, np.dtype(value.scale_dtype).name
    return (
        f"void(float32[:, :, ::1], int32[:, ::1], int32[:, ::1], uint32[::1], {k_scale}[::1], uint32[::1], "
        f"{v_scale}[::1], int32, int32, int32, float32[:, :, :, ::1], float32[:, :, :, ::1])"
    )


@cache
def _partial_kernel(format_name: str, group: int, head_dim: int, warps: int, unroll: int) -> Any:
    """The split-K kernel specialised for the format, G, hd and the tiling (constant register array sizes)."""
    key, value = GPU_FORMATS[format_name]
    key_tq3, value_tq3 = key.name == "tq3", value.name == "tq3"
    lanes_per_row = head_dim // LANE_VALUES
    slots = WARP_SIZE // lanes_per_row
    tile = warps * slots * unroll
    # uint32 words and scales per vector; chunks (lanes) per scale
    key_words, value_words = (c.codes_per_vector(head_dim) * np.dtype(c.code_dtype).itemsize // 4 for c in (key, value))
    key_scales, value_scales = key.scales_per_vector(head_dim), value.scales_per_vector(head_dim)
    key_chunks, value_chunks = key.values_per_scale // LANE_VALUES, value.values_per_scale // LANE_VALUES
    scale = float32(head_dim**-0.5)
    lane_values, step_scores, step_words = group * LANE_VALUES, unroll * group, unroll * 2
    streams = warps * slots
    shared_values, shared_heads = streams * group * head_dim, streams * group

    def attention_partial(
        q, positions, page_table, k_codes, k_scales, v_codes, v_scales, num_kv_heads, page_tokens,
        min_split_tokens, partial_acc, partial_ml,
    ):  # fmt: skip
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
            return  # whole block: the shuffles and barriers below stay uniform
        stop = min(start + per_split, length)

        book = cuda.shared.array(8, float32)
        if thread < 8:
            book[thread] = TQ3_BOOK[thread]
        query = cuda.local.array(lane_values, float32)
        acc = cuda.local.array(lane_values, float32)
        running_max = cuda.local.array(group, float32)
        running_sum = cuda.local.array(group, float32)
        scores = cuda.local.array(step_scores, float32)
        k_raw = cuda.local.array(step_words, uint32)
        v_raw = cuda.local.array(step_words, uint32)
        k_scale = cuda.local.array(unroll, float32)
        v_scale = cuda.local.array(unroll, float32)
        for g in range(group):
            running_max[g] = _NEG
            running_sum[g] = float32(0)
            for i in range(LANE_VALUES):
                query[g * LANE_VALUES + i] = q[row, kv_head * group + g, chunk * LANE_VALUES + i]
                acc[g * LANE_VALUES + i] = float32(0)
        if key_tq3:
            rotate_lane_queries(query, lane_values, chunk)  # then the score scale
        for j in range(lane_values):
            query[j] *= scale
        cuda.syncthreads()  # the codebook

        page_slot = start // page_tokens
        page_offset = start - page_slot * page_tokens  # tiles never straddle pages
        for tile_start in range(start, stop, tile):
            page = int64(page_table[row, page_slot])
            for u in range(unroll):
                token = (warp * unroll + u) * slots + slot
                if tile_start + token < stop:
                    cache_row = (page * page_tokens + page_offset + token) * num_kv_heads + kv_head
                    if key_tq3:
                        k_raw[2 * u] = tq3_lane_bits(k_codes, cache_row * key_words, chunk)
                    else:
                        k_raw[2 * u] = k_codes[cache_row * key_words + 2 * chunk]
                        k_raw[2 * u + 1] = k_codes[cache_row * key_words + 2 * chunk + 1]
                    if value_tq3:
                        v_raw[2 * u] = tq3_lane_bits(v_codes, cache_row * value_words, chunk)
                    else:
                        v_raw[2 * u] = v_codes[cache_row * value_words + 2 * chunk]
                        v_raw[2 * u + 1] = v_codes[cache_row * value_words + 2 * chunk + 1]
                    k_scale[u] = float32(k_scales[cache_row * key_scales + chunk // key_chunks])
                    v_scale[u] = float32(v_scales[cache_row * value_scales + chunk // value_chunks])
                else:
                    k_raw[2 * u] = k_raw[2 * u + 1] = v_raw[2 * u] = v_raw[2 * u + 1] = uint32(0)
                    k_scale[u] = v_scale[u] = float32(0)
            for u in range(unroll):
                for g in range(group):
                    scores[u * group + g] = float32(0)
                for i in range(LANE_VALUES):
                    if key_tq3:
                        level = book[(k_raw[2 * u] >> uint32(3 * i)) & uint32(7)]
                    else:
                        level = q8_value(k_raw[2 * u + i // 4], i % 4)
                    for g in range(group):
                        scores[u * group + g] += query[g * LANE_VALUES + i] * level
                for g in range(group):
                    scores[u * group + g] *= k_scale[u]
            for j in range(step_scores):  # all lanes, uniform: the simulator's shuffles need that
                scores[j] = _row_sum(scores[j], lanes_per_row)

            for g in range(group):
                tile_max = _NEG  # over real tokens only, as attention.py
                for u in range(unroll):
                    if tile_start + (warp * unroll + u) * slots + slot < stop:
                        tile_max = max(tile_max, scores[u * group + g])
                new_max = max(running_max[g], tile_max)
                correction = math.exp(running_max[g] - new_max)
                running_max[g] = new_max
                if correction != float32(1):
                    running_sum[g] *= correction
                    for i in range(LANE_VALUES):
                        acc[g * LANE_VALUES + i] *= correction
                for u in range(unroll):
                    token = (warp * unroll + u) * slots + slot
                    weight = float32(0)
                    if tile_start + token < stop:
                        weight = math.exp(scores[u * group + g] - new_max)
                    running_sum[g] += weight
                    scores[u * group + g] = weight * v_scale[u]  # the value's scale folded into its weight
            for u in range(unroll):
                for i in range(LANE_VALUES):
                    if value_tq3:
                        level = book[(v_raw[2 * u] >> uint32(3 * i)) & uint32(7)]
                    else:
                        level = q8_value(v_raw[2 * u + i // 4], i % 4)
                    for g in range(group):
                        acc[g * LANE_VALUES + i] += scores[u * group + g] * level

            page_offset += tile
            if page_offset == page_tokens:
                page_offset = 0
                page_slot += 1

        # The streams' merge, as attention.py's.
        shared_acc = cuda.shared.array(shared_values, float32)
        shared_max = cuda.shared.array(shared_heads, float32)
        shared_sum = cuda.shared.array(shared_heads, float32)
        stream = warp * slots + slot
        for g in range(group):
            for i in range(LANE_VALUES):
                shared_acc[(stream * group + g) * head_dim + chunk * LANE_VALUES + i] = acc[g * LANE_VALUES + i]
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
                weight = math.exp(shared_max[other * group + g] - top)
                total += weight * shared_acc[(other * group + g) * head_dim + dim]
                weights += weight * shared_sum[other * group + g]
            head = kv_head * group + g
            partial_acc[row, head, split, dim] = total
            if dim == 0:
                partial_ml[row, head, split, 0] = top
                partial_ml[row, head, split, 1] = weights

    name = f"attention_{format_name.replace('-', '_')}_partial_g{group}_d{head_dim}_w{warps}_u{unroll}"
    attention_partial.__name__ = attention_partial.__qualname__ = name
    return kernel(_signature(format_name), early_launch=True)(attention_partial)


_DEFAULT = DecodeAttentionConfig(num_splits=1)
for _format in GPU_FORMATS:  # the released sizes at the device table's tiling, for the PTX and SASS checks
    for _group in (4, 6):
        _partial_kernel(_format, _group, 256, _DEFAULT.warps, _DEFAULT.unroll)


UNROTATE_PARTS = 4
"""Split sums per dim in a combine block: its 128 dims x 4 threads, each summing every 4th split."""
UNROTATE_THREADS = TQ3_BLOCK * UNROTATE_PARTS


@kernel(
    "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, ::1], int32[:, ::1], int32, int32, int32, "
    "float32[:, ::1])"
)
def attention_combine_unrotate(partial_acc, partial_ml, qkv, positions, capacity, tile, min_split_tokens, out):
    """out[row, head, one 128-block] = the splits' partials merged, normalised, rotated back (the WHT, then the
    sign flip: `kv_formats.unrotate`), times sigmoid(gate). One block per (head, row, 128-block)."""
    head, row, block = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    thread = cuda.threadIdx.x
    lane = thread % WARP_SIZE
    i, part = thread % TQ3_BLOCK, thread // TQ3_BLOCK
    head_dim = partial_acc.shape[3]
    dim = block * TQ3_BLOCK + i
    cache_index = positions[row, 0]
    if cache_index < 0 or cache_index >= capacity:
        if part == 0:
            out[row, head * head_dim + dim] = float32(0)
        return
    length = cache_index + 1
    per_split = split_tokens(length, partial_acc.shape[2], min_split_tokens, tile)
    active = (length + per_split - 1) // per_split

    top = _NEG  # every warp finds the max and the normaliser itself, as attention_combine
    for s in range(lane, active, WARP_SIZE):
        top = max(top, partial_ml[row, head, s, 0])
    top = warp_max_f32(top)
    norm = float32(0)
    for s in range(lane, active, WARP_SIZE):
        norm += math.exp(partial_ml[row, head, s, 0] - top) * partial_ml[row, head, s, 1]
    norm = warp_sum_f32(norm)
    total = float32(0)
    s = part
    while s + UNROTATE_PARTS < active:  # two independent loads before their sums
        a0 = partial_acc[row, head, s, dim]
        a1 = partial_acc[row, head, s + UNROTATE_PARTS, dim]
        total += math.exp(partial_ml[row, head, s, 0] - top) * a0
        total += math.exp(partial_ml[row, head, s + UNROTATE_PARTS, 0] - top) * a1
        s += 2 * UNROTATE_PARTS
    if s < active:
        total += math.exp(partial_ml[row, head, s, 0] - top) * partial_acc[row, head, s, dim]
    sums = cuda.shared.array(UNROTATE_THREADS, float32)
    rotated = cuda.shared.array(TQ3_BLOCK, float32)
    sums[thread] = total
    cuda.syncthreads()
    if part == 0:
        for other in range(1, UNROTATE_PARTS):
            total += sums[other * TQ3_BLOCK + i]
        rotated[i] = total / norm
    cuda.syncthreads()
    attended = unrotate_block(rotated, 0, i, part == 0)
    if part == 0:
        out[row, head * head_dim + dim] = gated(attended, qkv, row, head, dim, head_dim)


@kernel("void(float32[::1], int32)", early_launch=True)
def rotate_queries(q, head_dim):
    """Every vector of q (flat, hd values each) through `kv_formats.rotate`, in place: prefill attention over
    tq3 keys scores in their domain. A block is one warp of 32 / (hd / 8) vectors, a lane 8 dims of one."""
    wait_for_prior_grids()
    allow_dependent_grids()
    lanes_per_row = head_dim // LANE_VALUES
    lane = cuda.threadIdx.x
    vector = cuda.blockIdx.x * (WARP_SIZE // lanes_per_row) + lane // lanes_per_row
    chunk = lane % lanes_per_row
    present = vector * head_dim < q.shape[0]
    base = vector * head_dim + chunk * LANE_VALUES
    values = cuda.local.array(LANE_VALUES, float32)
    for i in range(LANE_VALUES):
        values[i] = q[base + i] if present else float32(0)
    rotate_lane_queries(values, LANE_VALUES, chunk)  # every lane: the shuffles stay uniform
    if present:
        for i in range(LANE_VALUES):
            q[base + i] = values[i]


def rotate_queries_launch(q: Any) -> Launch:
    """The launch that rotates q fp32 [R, H, hd] in place into tq3's domain (`rotate_queries`)."""
    rows, num_heads, head_dim = check_array(q, "q", np.float32, 3)
    TQ3_CODES.check(head_dim)
    per_block = WARP_SIZE // (head_dim // LANE_VALUES)
    blocks = -(-rows * num_heads // per_block)
    return Launch(rotate_queries, max(blocks, 1), WARP_SIZE, (q.reshape(-1), np.int32(head_dim)))


def compressed_decode_attention(
    q: Any,
    qkv: Any,
    decode_positions: Any,
    page_table: Any,
    caches: tuple[Any, ...],
    format_name: str,
    partial_acc: Any,
    partial_ml: Any,
    out: Any,
    config: DecodeAttentionConfig,
) -> tuple[Launch, Launch]:
    """The two launches of one decode-attention step over a compressed cache (run them in order).

    As `attention.decode_attention`, with caches = (key codes, key scales, value codes, value scales) of the
    `format_name` format (`kv_codes`, `KvPages.caches`) holding this step's token already (`kv_write`). q fp32
    [B, H, hd] after norm and RoPE, unrotated: the kernel rotates it for tq3 keys.
    """
    batch, num_heads, head_dim = check_array(q, "q", np.float32, 3)
    if not caches or len(caches[0].shape) != 4:
        raise ValueError("a compressed cache is 4 arrays [pages, page_tokens, Hkv, n]")
    num_kv_heads = int(caches[0].shape[2])
    _, page_tokens = check_caches(caches, format_name, num_kv_heads, head_dim)
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
    k_codes, k_scales, v_codes, v_scales = (array.reshape(-1) for array in caches)
    sizes = (np.int32(num_kv_heads), np.int32(page_tokens), np.int32(min_split))
    partial = Launch(
        _partial_kernel(format_name, group, head_dim, config.warps, config.unroll),
        (num_kv_heads, config.num_splits, batch),
        config.warps * WARP_SIZE,
        (q, decode_positions, page_table, k_codes.view(np.uint32), k_scales, v_codes.view(np.uint32), v_scales,
         *sizes, partial_acc, partial_ml),
    )  # fmt: skip
    capacity = np.int32(page_table.shape[1] * page_tokens)
    combine_args = (partial_acc, partial_ml, qkv, decode_positions, capacity, np.int32(tile), np.int32(min_split), out)
    if GPU_FORMATS[format_name][1].name == "tq3":
        combine = Launch(
            attention_combine_unrotate, (num_heads, batch, head_dim // TQ3_BLOCK), UNROTATE_THREADS, combine_args
        )
    else:
        combine = Launch(attention_combine, (num_heads, batch, head_dim // WARP_SIZE), COMBINE_THREADS, combine_args)
    return partial, combine
