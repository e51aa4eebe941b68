"""Prefill attention for the long-prompt step: FlashAttention-style, every K/V tile shared by a tile of rows.

The long-prompt step runs R (256) consecutive tokens ("rows") of one sequence. `decode_attention` would read
each row's whole causal prefix: rows x context cache reads. Here a block takes a tile of Bq query tokens and
all G = H/Hkv query heads of one KV head (M = Bq*G query vectors), so each K/V tile read from the cache
serves M query vectors, and the work is fp32 FMAs on shared-memory operands (no tensor cores: docs/hardware.md).

Inputs are those of `decode_attention` (attention.py: KV-cache layout, `positions`, `page_table`):
- q fp32 [R, H, hd] (normed + RoPE'd), qkv fp32 [R, 2*(H+Hkv)*hd] (the gate of head h is columns
  (2h+1)*hd..(2h+2)*hd), out fp32 [R, H*hd] = attention * sigmoid(gate).
- positions[r, 0] is row r's cache index: its own K/V are in the cache there, it attends to 0..index. A row
  whose index is negative or past the capacity is inactive (output 0).
- What the kernel assumes of the device data (the launcher cannot check it): the rows of one query tile
  belong to one sequence, so the page-table row of any active row serves them all, and every cache index
  from 0 to the largest index in a tile is written (true for consecutive tokens with their K/V stored
  first). The masks are per row, so any order is correct; consecutive ascending rows (the prompt step) are
  what makes the causal tile skipping effective.

Launches (`prefill_attention`): a partial kernel over (query tile, KV head, split) blocks writing
unnormalised partials (acc, running max, sum) per row, head and split, then a combine that merges the splits
and applies the gate (one block of hd threads per (head, row)). The partial buffers have the layout of the
decode ones ([R, H, splits, hd] and [R, H, splits, 2]).

Splits: a query tile attends to keys 0..L-1 with L = its largest cache index + 1 (read on the device). That
range is cut into `num_splits` pieces of whole key tiles, at least `min_split_tokens` each (`split_tokens` of
attention.py), so key tiles past the tile's last row are never visited (causal skipping) and a captured
graph keeps its split count while the context grows. A (query tile, KV head) grid is only 256/Bq x Hkv
blocks (16 x 4 = 64): `PrefillAttentionConfig.splits_for` picks the split count that fills the GPU. The
combine recomputes L and the piece size per row from `positions`, so it reads exactly the splits that saw
keys of that row (each such split has at least one unmasked key for it).

Tiling of the partial kernel (`PrefillAttentionConfig`; GPU defaults in brackets, hd 256):
- A block is [8] warps. Warp w owns query tokens w*TQ..w*TQ+TQ-1 of the tile and all G heads of each:
  TM = TQ*G rows (TQ = max(1, 8 // G): [G=4: TQ 2, TM 8, Bq 16]; [G=6: TQ 1, TM 6, Bq 8]).
- Key tiles of Bk = 32*key_lanes [64] keys. Per key tile:
  1. Scores S[TM, Bk] per warp, lane l owning keys l and l+32: hd is walked in rounds of [32] dims; each
     round the block stages the Q chunk (M x 32 fp32, times hd^-1/2) and the K chunk (Bk x 32, fp16 -> fp32)
     in shared memory (16-byte global loads), then each lane, per 4 dims, loads its 2 keys' 4 values (two
     16-byte loads, distinct rows: pitch 36 words makes a quarter-warp's 8 rows hit 8 distinct bank quads)
     and each row's 4 query values (16-byte broadcast loads) and runs TM x 2 x 4 FMAs: 64 FFMA per 10 shared
     loads at TM 8 (16 bank wavefronts: half the shared bandwidth at full FFMA rate).
  2. Online softmax per row in fp32: the tile max over the unmasked keys (a warp butterfly), the rescale of
     the row's accumulators when the max moves, weights exp(s - max) (0 for masked keys, selected, never
     multiplied, so masked garbage cannot leak), written to the warp's P[TM, Bk] in shared memory. Each lane
     keeps its own share of the row sums (same rescales), summed over the warp once at the end.
  3. O[TM, hd] += P V: each lane owns 8 dims (two float4 at 4*l and 128 + 4*l: conflict-free), O in
     registers (TM x 8 = [64] floats). V is staged [16] keys x hd at a time (fp16 -> fp32). Per 4 keys a lane
     loads 4 weights of each row (TM 16-byte broadcast loads) and per key its 8 values (two 16-byte loads):
     256 FFMA per 16 shared loads at TM 8.
  Keys past the split's end are staged as zeros (slots there may be unwritten); masks are per row
  (key <= the row's cache index, key < split end), so the diagonal tiles need no special path.
- Shared memory (static, fp32): one staging buffer max(M*32 + Bk*36, 16*hd) words (the score rounds use
  Q|K, the P.V rounds V) and P[M, Bk]: [G=4: 33,024 bytes; G=6: 27,648] (ptxas: 33,792 and 28,672).
- Rounds are software-pipelined: after the barrier that publishes round n, each thread issues round n+1's
  global loads into registers (2 float4 of Q and 1 uint4 of K, or 2 uint4 of V), then computes round n; so
  the L2 latency hides behind a round's FMAs ([2,048-4,096] SM cycles at FFMA rate) with one block per SM.
  Per key tile: [8] score + [4] P.V rounds, two barriers each.
- Registers (ptxas -v, sm_70, `python -m cmpchat.devtools.ptx_check`): [G=4: 238; G=6: 189], no spills, with
  launch bounds of [1] block of 256 threads per SM (8 warps; 33 KB of the 96 KB shared memory). O (TM*8),
  S (TM*2), the row max/sum shares (2*TM), 4 weights per row and the prefetched round live together; at
  2 blocks per SM (128 registers) ptxas spills even at TM 4, so the ILP of one block's register tiles, not a
  second block, hides the shared-memory latency.
- Work per key tile and thread: 2 x TM x Bk x hd / 256 = [1,024 x TM] FMAs next to ~16 16-byte staging
  loads and stores. fp32 FMA rate, shared bandwidth (sm_70: 64 FFMA and 128 bytes per SM cycle): scores
  need 1/TM + 1/(4*key_lanes) bank wavefronts per warp FFMA, P.V 1/TM + 1/32, [0.25 and 0.16 at TM 8]: under
  the 0.5 at which shared memory would limit. (Hopper issues 128 FFMA per SM cycle with the same 128 bytes of
  shared bandwidth: there the scores are at that limit.)
- Global traffic: each query tile reads its key range of K and V once: 256 rows at 64K context, 9B, is 16
  tiles x 64K keys x 4 KV heads x 1 KB = 4.3 GB per layer (27B: 32 tiles, 8.6 GB) next to 137 G (206 G) FMAs,
  so even from DRAM (818 GB/s: 5.3 ms vs ~27 ms of FFMA at 10 TFLOP) the kernel stays FFMA-bound; the query
  tiles of a (KV head, split) run together (query tiles are blockIdx.x), so most K/V reads hit L2. Q chunks
  are re-read per key tile from L1/L2 (M x hd x 4 bytes next to Bk x hd x 4 of K and V).
The simulator runs one Python thread per CUDA thread: its tests use 2-warp blocks, 32-key tiles and
smaller rounds (the same body).

Over a compressed cache (`compressed_prefill_attention`, the formats of `kv_codes.GPU_FORMATS`) the same body
stages the codes' values instead of fp16 (`_cache_reader`): a thread's 16-byte load of 8 fp16 values becomes
the codes of those 8 dims (tq3: its 24 bits, one or two words, `kv_codes.tq3_lane_bits`; q8: two words) and
their scale, decoded to fp32 when staged (tq3: codebook level x the 128-block's scale, the 8 levels in shared
memory; q8: int8 x the fp16 scale of its 32). Attention runs in the codes' domain, as `attention_compressed`:
for tq3 keys q is rotated in place first (`rotate_queries`: `kv_formats.rotate`), for tq3 values the combine
rotates each head's merged output back before the gate (`attention_prefill_combine_unrotate`). The rounds'
shapes, shared memory and registers are the fp16 kernel's (ptxas: G=4 234-238, G=6 189-191, no spills).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    SIMULATOR,
    WARP_SIZE,
    load_f32x4,
    load_u32x4,
    unpack_f16x2,
    warp_max_f32,
    warp_sum_f32,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.attention import (
    _NEG,
    MAX_GROUP,
    MAX_SPLITS,
    POSITION_COLUMNS,
    _words,
    check_kv_cache,
    gated,
    merge_splits,
    split_tokens,
)
from cmpchat.kernels.attention_compressed import rotate_queries_launch, unrotate_block
from cmpchat.kernels.kv_codes import (
    GPU_FORMATS,
    LANE_VALUES,
    TQ3_BOOK,
    CodeArrays,
    check_caches,
    q8_value,
    tq3_lane_bits,
)
from cmpchat.kv_formats import TQ3_BLOCK

SHARED_ALIGNMENT = None if SIMULATOR else 16  # lets the compiler use 16-byte shared loads and stores
MAX_GRID_YZ = 65535
FP16_SOURCE = "f16"
"""The partial kernel's source for the fp16 cache; the compressed ones are named as `kv_codes.GPU_FORMATS`."""
TQ3_LEVELS = 8
MAX_UNROTATE_DIM = 256  # the compressed codes' largest head size (`kv_codes.CodeArrays.check`)


# --- configuration ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillAttentionConfig:
    """How prefill attention is cut up; fixed for a captured graph (the cache indices are not)."""

    num_splits: int
    """Key-range pieces per (query tile, KV head); `splits_for` picks one that fills the GPU."""
    min_split_tokens: int = 128
    """A piece has at least this many keys (rounded up to whole key tiles): short prompts then use few
    blocks, whose partials (M x hd x 4 bytes each, written and read back) stay small next to their work."""
    warps: int = 8
    warp_tokens: int = 0
    """Query tokens per warp (TQ); 0: max(1, 8 // G), i.e. 8 rows per warp for G = 1, 2, 4, 8."""
    key_lanes: int = 2
    """Keys per lane in a key tile: Bk = 32 * key_lanes."""
    qk_dims: int = 32
    """Head dims staged per score round (a multiple of 8 dividing hd)."""
    pv_keys: int = 16
    """Keys of V staged per P.V round (a multiple of 4 dividing Bk)."""
    blocks_per_sm: int = 1
    """Resident blocks per SM the registers are capped for (launch bounds)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {self.num_splits}")
        bad = (
            self.min_split_tokens < 1
            or not 1 <= self.warps <= 32
            or self.warp_tokens < 0
            or self.key_lanes < 1
            or self.qk_dims < 8
            or self.qk_dims % 8
            or self.pv_keys < 4
            or self.pv_keys % 4
            or self.tile_keys % self.pv_keys
            or self.blocks_per_sm < 1
        )
        if bad:
            raise ValueError(f"invalid prefill attention config {self}")

    @property
    def tile_keys(self) -> int:
        """Keys per key tile (Bk); page_tokens must be a multiple of it."""
        return WARP_SIZE * self.key_lanes

    @property
    def threads(self) -> int:
        return WARP_SIZE * self.warps

    def tokens_per_warp(self, group: int) -> int:
        return self.warp_tokens or max(1, 8 // group)

    def query_tokens(self, group: int) -> int:
        """Query tokens per block (Bq)."""
        return self.warps * self.tokens_per_warp(group)

    def shared_bytes(self, group: int, head_dim: int) -> int:
        """Static shared memory of the partial kernel."""
        block_rows = self.query_tokens(group) * group
        stage = max(block_rows * self.qk_dims + self.tile_keys * (self.qk_dims + 4), self.pv_keys * head_dim)
        return 4 * (stage + block_rows * self.tile_keys)

    @classmethod
    def splits_for(
        cls,
        rows: int,
        num_heads: int,
        num_kv_heads: int,
        sm_count: int,
        waves: int = 4,
        **tiling: Any,
    ) -> PrefillAttentionConfig:
        """Enough splits that a long prompt step gives every SM `waves` rounds of its resident blocks."""
        probe = cls(num_splits=1, **tiling)
        tiles = -(-rows // probe.query_tokens(num_heads // num_kv_heads))
        wanted = math.ceil(sm_count * probe.blocks_per_sm * waves / (tiles * num_kv_heads))
        return cls(num_splits=max(1, min(MAX_SPLITS, wanted)), **tiling)


SIMULATOR_CONFIG = dict(warps=2, key_lanes=1, qk_dims=16, pv_keys=8, min_split_tokens=32)
"""A tiling small enough for the simulator (one Python thread per CUDA thread): 2 warps, 32-key tiles. Which
tiling the engine launches with is the device's choice (`DeviceTuning.prefill_attention`, `device_table.py`)."""


def partial_buffer_shapes(
    rows: int, num_heads: int, head_dim: int, config: PrefillAttentionConfig
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 scratch the backend allocates once: partial_acc and partial_ml (max, sum). Same
    layout as the decode partials, so one allocation of the larger can serve both."""
    return (rows, num_heads, config.num_splits, head_dim), (rows, num_heads, config.num_splits, 2)


# --- device helpers --------------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def query_tile_extent(positions, first_row, query_tokens, capacity):
    """(keys the query tile attends to: its largest active cache index + 1, or 0; the row holding it)."""
    length = 0
    source = first_row
    for row in range(first_row, min(first_row + query_tokens, positions.shape[0])):
        index = positions[row, 0]
        if index >= 0 and index < capacity and index + 1 > length:
            length = index + 1
            source = row
    return length, source


@cuda.jit(device=True, inline=True)
def _store_halves(stage, target, w0, w1, w2, w3):
    """stage[target : target + 8] = the 8 fp16 values packed in the 4 words, as fp32 (target unsigned)."""
    stage[target], stage[target + uint64(1)] = unpack_f16x2(w0)
    stage[target + uint64(2)], stage[target + uint64(3)] = unpack_f16x2(w1)
    stage[target + uint64(4)], stage[target + uint64(5)] = unpack_f16x2(w2)
    stage[target + uint64(6)], stage[target + uint64(7)] = unpack_f16x2(w3)


def _cache_reader(codec: CodeArrays | None, head_dim: int) -> tuple[Any, Any]:
    """(fetch, store) of the 8 values of one (cache row, 8-dim chunk) of a K or V cache with these codes (None:
    fp16). fetch(codes, scales, cache row, chunk) -> 4 words and a scale: the raw loads, held in registers
    across a round; store(stage, target, words, scale, book) writes the 8 values as fp32 to stage[target:],
    in the codes' domain (tq3: rotated; `book` the codebook in shared memory). Zero words and scale are 8 zeros."""
    if codec is None:
        words_per_row = head_dim // 2

        @cuda.jit(device=True, inline=True)
        def fetch_f16(codes, scales, cache_row, chunk):
            w0, w1, w2, w3 = load_u32x4(codes, cache_row * words_per_row + 4 * chunk)
            return w0, w1, w2, w3, float32(0)

        @cuda.jit(device=True, inline=True)
        def store_f16(stage, target, w0, w1, w2, w3, scale, book):
            _store_halves(stage, target, w0, w1, w2, w3)

        return fetch_f16, store_f16
    words = codec.codes_per_vector(head_dim) * np.dtype(codec.code_dtype).itemsize // 4
    scales_per_row, chunks_per_scale = codec.scales_per_vector(head_dim), codec.values_per_scale // LANE_VALUES
    if codec.name == "tq3":

        @cuda.jit(device=True, inline=True)
        def fetch_tq3(codes, scales, cache_row, chunk):
            bits = tq3_lane_bits(codes, cache_row * words, chunk)
            scale = scales[cache_row * scales_per_row + chunk // chunks_per_scale]
            return bits, uint32(0), uint32(0), uint32(0), float32(scale)

        @cuda.jit(device=True, inline=True)
        def store_tq3(stage, target, w0, w1, w2, w3, scale, book):
            for i in range(LANE_VALUES):
                stage[target + uint64(i)] = book[(w0 >> uint32(3 * i)) & uint32(7)] * scale

        return fetch_tq3, store_tq3

    @cuda.jit(device=True, inline=True)
    def fetch_q8(codes, scales, cache_row, chunk):
        word = cache_row * words + 2 * chunk
        scale = scales[cache_row * scales_per_row + chunk // chunks_per_scale]
        return codes[word], codes[word + 1], uint32(0), uint32(0), float32(scale)

    @cuda.jit(device=True, inline=True)
    def store_q8(stage, target, w0, w1, w2, w3, scale, book):
        for i in range(4):
            stage[target + uint64(i)] = q8_value(w0, i) * scale
            stage[target + uint64(4 + i)] = q8_value(w1, i) * scale

    return fetch_q8, store_q8


# --- kernels ---------------------------------------------------------------------------------------------


def _partial_signature(source: str) -> str:
    """fp16: the K and V caches as words; a compressed format: their codes as words and their scales."""
    if source == FP16_SOURCE:
        caches = "uint32[::1], uint32[::1]"
    else:
        key_scales, value_scales = (np.dtype(codec.scale_dtype).name for codec in GPU_FORMATS[source])
        caches = f"uint32[::1], {key_scales}[::1], uint32[::1], {value_scales}[::1]"
    return (
        f"void(float32[::1], int32[:, ::1], int32[:, ::1], {caches}, int32, int32, int32, "
        "float32[:, :, :, ::1], float32[:, :, :, ::1])"
    )


@cache
def _partial_kernel(
    source: str,
    group: int,
    head_dim: int,
    warps: int,
    warp_tokens: int,
    key_lanes: int,
    qk_dims: int,
    pv_keys: int,
    blocks_per_sm: int,
) -> Any:
    """The partial kernel specialised for the cache's format (`source`: "f16" or one of `GPU_FORMATS`), G, hd and
    the tiling (register arrays need constant sizes)."""
    codecs = (None, None) if source == FP16_SOURCE else GPU_FORMATS[source]
    (fetch_key, store_key), (fetch_value, store_value) = (_cache_reader(codec, head_dim) for codec in codecs)
    needs_book = any(codec is not None and codec.name == "tq3" for codec in codecs)
    threads = warps * WARP_SIZE
    rows = warp_tokens * group  # TM: query vectors per warp
    block_rows = warps * rows  # M
    query_tokens = warps * warp_tokens  # Bq
    tile = WARP_SIZE * key_lanes  # Bk
    lane_dims = head_dim // WARP_SIZE  # output dims per lane
    vec = min(4, lane_dims)  # a lane's dims are `vectors` runs of `vec`, runs 32*vec apart
    vectors = lane_dims // vec
    k_pitch = qk_dims + 4  # an odd multiple of 4 words when qk_dims is a multiple of 8: see the docstring
    q_size = block_rows * qk_dims
    stage_size = max(q_size + tile * k_pitch, pv_keys * head_dim)
    probs_size = block_rows * tile
    warp_probs = rows * tile
    scale = float32(head_dim**-0.5)
    qk_rounds, pv_rounds = head_dim // qk_dims, tile // pv_keys
    q_groups, k_groups, v_groups = qk_dims // 4, qk_dims // 8, head_dim // 8  # 16-byte loads per staged row
    q_loads, k_loads, v_loads = block_rows * q_groups, tile * k_groups, pv_keys * v_groups
    # Register arrays (sizes must be plain constants when Numba types the kernel).
    acc_size, score_size, weight_size, key_size = rows * lane_dims, rows * key_lanes, rows * 4, key_lanes * 4
    q_per_thread, k_per_thread, v_per_thread = (-(-count // threads) for count in (q_loads, k_loads, v_loads))
    fetched_q_size, fetched_loads = 4 * q_per_thread, max(k_per_thread, v_per_thread)
    fetched_size = 4 * fetched_loads

    @cuda.jit(device=True, inline=True)
    def partial(
        q, positions, page_table, k_codes, k_scales, v_codes, v_scales, num_kv_heads, page_tokens, min_split_tokens,
        partial_acc, partial_ml,
    ):  # fmt: skip
        q_tile, kv_head, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        thread = cuda.threadIdx.x
        lane, warp = thread % WARP_SIZE, thread // WARP_SIZE
        num_rows, num_heads = positions.shape[0], partial_acc.shape[1]
        capacity = page_table.shape[1] * page_tokens
        first_row = q_tile * query_tokens
        length, source_row = query_tile_extent(positions, first_row, query_tokens, capacity)
        per_split = split_tokens(length, partial_acc.shape[2], min_split_tokens, tile)
        start = split * per_split
        if start >= length:
            return  # whole block (also for a tile without active rows): the barriers below stay uniform
        stop = min(start + per_split, length)

        limits = cuda.local.array(warp_tokens, int64)  # cache index of each of the warp's tokens; -1: none
        acc = cuda.local.array(acc_size, float32)  # acc[r * lane_dims + i]: row r, this lane's dim i
        row_max = cuda.local.array(rows, float32)
        row_sum = cuda.local.array(rows, float32)  # this lane's share of the row's sum of weights
        scores = cuda.local.array(score_size, float32)  # scores[r * key_lanes + j]: row r, key lane + 32 j
        keys = cuda.local.array(key_size, float32)
        weights = cuda.local.array(weight_size, float32)
        values = cuda.local.array(lane_dims, float32)
        fetched_q = cuda.local.array(fetched_q_size, float32)  # the next round's staging loads
        # The raw words (and scales) of the next round's K or V; decoded when staged, after the barrier, so the
        # loads stay in flight behind this round's FMAs (decoding them at once would wait for them here).
        fetched = cuda.local.array(fetched_size, uint32)
        fetched_scales = cuda.local.array(fetched_loads, float32)
        for t in range(warp_tokens):
            row = first_row + warp * warp_tokens + t
            limit = int64(-1)
            if row < num_rows:
                index = positions[row, 0]
                if index >= 0 and index < capacity:
                    limit = int64(index)
            limits[t] = limit
        for r in range(rows):
            row_max[r] = _NEG
            row_sum[r] = float32(0)
            for i in range(lane_dims):
                acc[r * lane_dims + i] = float32(0)

        stage = cuda.shared.array(stage_size, float32, alignment=SHARED_ALIGNMENT)
        probs = cuda.shared.array(probs_size, float32, alignment=SHARED_ALIGNMENT)
        book = cuda.shared.array(TQ3_LEVELS, float32)  # tq3's levels; published by the first round's barrier
        if needs_book and thread < TQ3_LEVELS:
            book[thread] = TQ3_BOOK[thread]
        # Shared-memory indices are unsigned: Numba adds a negative-index test to every signed one.
        my_probs = uint64(warp * warp_probs + lane)  # this lane's key of each row of the warp's P
        my_weights = uint64(warp * warp_probs)
        my_queries = uint64(warp * rows * qk_dims)
        my_keys = uint64(q_size + lane * k_pitch)  # key `lane` of the staged K chunk
        my_values = uint64(lane * vec)
        # Rounds: per key tile qk_rounds score rounds, then pv_rounds P.V rounds. Software-pipelined: the
        # global loads of round n+1 go to registers while round n computes from shared memory.
        per_tile = qk_rounds + pv_rounds
        total_rounds = (stop - start + tile - 1) // tile * per_tile
        for step in range(total_rounds + 1):
            if step > 0:  # stage round step - 1 from the registers
                cuda.syncthreads()  # the previous round's readers are done with `stage`
                if (step - 1) % per_tile < qk_rounds:
                    for n in range(q_per_thread):
                        index = thread + n * threads
                        if index < q_loads:
                            target = uint64(index // q_groups * qk_dims + index % q_groups * 4)
                            for i in range(4):
                                stage[target + uint64(i)] = fetched_q[4 * n + i] * scale
                    for n in range(k_per_thread):
                        index = thread + n * threads
                        if index < k_loads:
                            target = uint64(q_size + index // k_groups * k_pitch + index % k_groups * 8)
                            store_key(stage, target, fetched[4 * n], fetched[4 * n + 1], fetched[4 * n + 2],
                                      fetched[4 * n + 3], fetched_scales[n], book)  # fmt: skip
                else:
                    for n in range(v_per_thread):
                        index = thread + n * threads
                        if index < v_loads:
                            target = uint64(index // v_groups * head_dim + index % v_groups * 8)
                            store_value(stage, target, fetched[4 * n], fetched[4 * n + 1], fetched[4 * n + 2],
                                        fetched[4 * n + 3], fetched_scales[n], book)  # fmt: skip
                cuda.syncthreads()
            if step < total_rounds:  # load round `step` into registers (zeros past the ends)
                phase = step % per_tile
                tile_start = start + step // per_tile * tile
                page = int64(page_table[source_row, tile_start // page_tokens])  # tiles never straddle pages
                first_key = page * page_tokens + tile_start % page_tokens  # cache row of the tile's key 0
                tile_keys = stop - tile_start  # keys of this split in the tile (more than `tile` but the last)
                if phase < qk_rounds:
                    for n in range(q_per_thread):
                        index = thread + n * threads
                        v0 = v1 = v2 = v3 = float32(0)
                        m = index // q_groups
                        token = first_row + m // group
                        if index < q_loads and token < num_rows:
                            head = kv_head * group + m % group
                            column = phase * qk_dims + index % q_groups * 4
                            v0, v1, v2, v3 = load_f32x4(q, (token * num_heads + head) * head_dim + column)
                        fetched_q[4 * n], fetched_q[4 * n + 1] = v0, v1
                        fetched_q[4 * n + 2], fetched_q[4 * n + 3] = v2, v3
                    for n in range(k_per_thread):
                        index = thread + n * threads
                        w0 = w1 = w2 = w3 = uint32(0)
                        code_scale = float32(0)
                        key = index // k_groups
                        if index < k_loads and key < tile_keys:  # past the split's end: zeros (maybe unwritten)
                            cache_row = (first_key + key) * num_kv_heads + kv_head
                            chunk = phase * k_groups + index % k_groups
                            w0, w1, w2, w3, code_scale = fetch_key(k_codes, k_scales, cache_row, chunk)
                        fetched[4 * n], fetched[4 * n + 1], fetched[4 * n + 2], fetched[4 * n + 3] = w0, w1, w2, w3
                        fetched_scales[n] = code_scale
                else:
                    for n in range(v_per_thread):
                        index = thread + n * threads
                        w0 = w1 = w2 = w3 = uint32(0)
                        code_scale = float32(0)
                        key = (phase - qk_rounds) * pv_keys + index // v_groups
                        if index < v_loads and key < tile_keys:
                            cache_row = (first_key + key) * num_kv_heads + kv_head
                            w0, w1, w2, w3, code_scale = fetch_value(v_codes, v_scales, cache_row, index % v_groups)
                        fetched[4 * n], fetched[4 * n + 1], fetched[4 * n + 2], fetched[4 * n + 3] = w0, w1, w2, w3
                        fetched_scales[n] = code_scale
            if step == 0:
                continue
            phase = (step - 1) % per_tile
            tile_start = start + (step - 1) // per_tile * tile
            if phase < qk_rounds:
                # 1. scores[TM, Bk] += (Q * hd^-1/2) K^T over this round's qk_dims dims
                if phase == 0:
                    for j in range(score_size):
                        scores[j] = float32(0)
                for d in range(0, qk_dims, 4):
                    for j in range(key_lanes):
                        source = my_keys + uint64(WARP_SIZE * j * k_pitch + d)
                        for i in range(4):
                            keys[4 * j + i] = stage[source + uint64(i)]
                    for r in range(rows):
                        source = my_queries + uint64(r * qk_dims + d)
                        a0, a1 = stage[source], stage[source + uint64(1)]
                        a2, a3 = stage[source + uint64(2)], stage[source + uint64(3)]
                        for j in range(key_lanes):
                            s = scores[r * key_lanes + j]
                            s = cuda.fma(a0, keys[4 * j], s)
                            s = cuda.fma(a1, keys[4 * j + 1], s)
                            s = cuda.fma(a2, keys[4 * j + 2], s)
                            scores[r * key_lanes + j] = cuda.fma(a3, keys[4 * j + 3], s)
                if phase == qk_rounds - 1:
                    # 2. online softmax, fp32; weights to the warp's P[TM, Bk] (read after the next barrier)
                    for r in range(rows):
                        limit = limits[r // group]
                        tile_max = _NEG  # over unmasked keys only
                        for j in range(key_lanes):
                            key = tile_start + lane + WARP_SIZE * j
                            if key < stop and key <= limit:
                                tile_max = max(tile_max, scores[r * key_lanes + j])
                        tile_max = warp_max_f32(tile_max)  # every thread, uniformly (the simulator needs that)
                        new_max = max(row_max[r], tile_max)
                        correction = math.exp(row_max[r] - new_max)  # 0 before the first key, 1 if it stays
                        row_max[r] = new_max
                        total = float32(0)
                        for j in range(key_lanes):
                            key = tile_start + lane + WARP_SIZE * j
                            weight = float32(0)
                            if key < stop and key <= limit:
                                weight = math.exp(scores[r * key_lanes + j] - new_max)
                            probs[my_probs + uint64(r * tile + WARP_SIZE * j)] = weight
                            total += weight
                        row_sum[r] = row_sum[r] * correction + total
                        if correction != float32(1):  # uniform over the warp
                            for i in range(lane_dims):
                                acc[r * lane_dims + i] *= correction
            else:
                # 3. O[TM, hd] += P V over this round's pv_keys keys
                chunk = phase - qk_rounds
                for k4 in range(0, pv_keys, 4):
                    for r in range(rows):
                        source = my_weights + uint64(r * tile + chunk * pv_keys + k4)
                        for i in range(4):
                            weights[4 * r + i] = probs[source + uint64(i)]
                    for kk in range(4):
                        for v in range(vectors):
                            source = my_values + uint64((k4 + kk) * head_dim + v * WARP_SIZE * vec)
                            for i in range(vec):
                                values[v * vec + i] = stage[source + uint64(i)]
                        for r in range(rows):
                            weight = weights[4 * r + kk]
                            for i in range(lane_dims):
                                acc[r * lane_dims + i] = cuda.fma(weight, values[i], acc[r * lane_dims + i])
        # Unnormalised partials of the rows that saw keys in this split.
        for r in range(rows):
            total = warp_sum_f32(row_sum[r])  # every thread, uniformly
            t = r // group
            row = first_row + warp * warp_tokens + t
            if limits[t] >= start:  # active, inside the rows (limit -1 otherwise), and a key in this split
                head = kv_head * group + r % group
                for v in range(vectors):
                    for i in range(vec):
                        partial_acc[row, head, split, v * WARP_SIZE * vec + lane * vec + i] = acc[
                            r * lane_dims + v * vec + i
                        ]
                if lane == 0:
                    partial_ml[row, head, split, 0] = row_max[r]
                    partial_ml[row, head, split, 1] = total

    def over_fp16(
        q, positions, page_table, k_words, v_words, num_kv_heads, page_tokens, min_split_tokens, partial_acc,
        partial_ml,
    ):  # fmt: skip
        # fp16 rows have no scales: the readers take the words in their place and ignore them
        partial(q, positions, page_table, k_words, k_words, v_words, v_words, num_kv_heads, page_tokens,
                min_split_tokens, partial_acc, partial_ml)  # fmt: skip

    def over_codes(
        q, positions, page_table, k_codes, k_scales, v_codes, v_scales, num_kv_heads, page_tokens, min_split_tokens,
        partial_acc, partial_ml,
    ):  # fmt: skip
        partial(q, positions, page_table, k_codes, k_scales, v_codes, v_scales, num_kv_heads, page_tokens,
                min_split_tokens, partial_acc, partial_ml)  # fmt: skip

    attention_prefill_partial = over_fp16 if source == FP16_SOURCE else over_codes
    prefix = "attention_prefill" if source == FP16_SOURCE else f"attention_prefill_{source.replace('-', '_')}"
    name = f"{prefix}_partial_g{group}_d{head_dim}_w{warps}_t{warp_tokens}_k{key_lanes}_q{qk_dims}_v{pv_keys}"
    attention_prefill_partial.__name__ = attention_prefill_partial.__qualname__ = name
    return kernel(_partial_signature(source), launch_bounds=(threads, blocks_per_sm))(attention_prefill_partial)


def partial_kernel(group: int, head_dim: int, config: PrefillAttentionConfig, source: str = FP16_SOURCE) -> Any:
    """The partial kernel over a `source` cache ("f16" or one of `kv_codes.GPU_FORMATS`) for G, hd and the
    config's tiling (defined and registered on first use)."""
    return _partial_kernel(
        source,
        group,
        head_dim,
        config.warps,
        config.tokens_per_warp(group),
        config.key_lanes,
        config.qk_dims,
        config.pv_keys,
        config.blocks_per_sm,
    )


# The released Qwen3.5 sizes have G = 4 (0.8B-9B) or 6 (27B) and hd 256: registered now so the PTX and SASS
# checks see them; other shapes (the tests' tiny ones) register on first use.
for _group in (4, 6):
    for _source in (FP16_SOURCE, *GPU_FORMATS):
        partial_kernel(_group, 256, PrefillAttentionConfig(num_splits=1), _source)
del _group, _source

_COMBINE_SIGNATURE = (
    "void(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, ::1], int32[:, ::1], int32, int32, int32, int32, "
    "float32[:, ::1])"
)


@cuda.jit(device=True, inline=True)
def _row_splits(partial_acc, positions, row, capacity, query_tokens, tile, min_split_tokens):
    """The splits holding keys 0..index of `row` (each at least one), or 0 for an inactive row."""
    index = positions[row, 0]
    if index < 0 or index >= capacity:
        return 0
    length, _ = query_tile_extent(positions, row // query_tokens * query_tokens, query_tokens, capacity)
    per_split = split_tokens(length, partial_acc.shape[2], min_split_tokens, tile)
    return (index + per_split) // per_split


@kernel(_COMBINE_SIGNATURE)
def attention_prefill_combine(
    partial_acc, partial_ml, qkv, positions, capacity, query_tokens, tile, min_split_tokens, out
):
    """out[row, head] = the splits' partials merged (weights exp(m_s - max)), normalised, times sigmoid(gate)."""
    head, row, dim = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    head_dim = partial_acc.shape[3]
    active = _row_splits(partial_acc, positions, row, capacity, query_tokens, tile, min_split_tokens)
    if active == 0:
        out[row, head * head_dim + dim] = float32(0)
        return
    merged = merge_splits(partial_acc, partial_ml, row, head, dim, active)
    out[row, head * head_dim + dim] = gated(merged, qkv, row, head, dim, head_dim)


@kernel(_COMBINE_SIGNATURE)
def attention_prefill_combine_unrotate(
    partial_acc, partial_ml, qkv, positions, capacity, query_tokens, tile, min_split_tokens, out
):
    """`attention_prefill_combine` over tq3 values: the merged head output is rotated back
    (`kv_formats.unrotate`, per 128-block in shared memory) before the gate."""
    head, row, dim = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    head_dim = partial_acc.shape[3]
    active = _row_splits(partial_acc, positions, row, capacity, query_tokens, tile, min_split_tokens)
    if active == 0:  # the whole block: the barriers below stay uniform
        out[row, head * head_dim + dim] = float32(0)
        return
    rotated = cuda.shared.array(MAX_UNROTATE_DIM, float32)
    rotated[dim] = merge_splits(partial_acc, partial_ml, row, head, dim, active)
    cuda.syncthreads()
    block = dim // TQ3_BLOCK
    attended = unrotate_block(rotated, block * TQ3_BLOCK, dim - block * TQ3_BLOCK, True)
    out[row, head * head_dim + dim] = gated(attended, qkv, row, head, dim, head_dim)


# --- launcher --------------------------------------------------------------------------------------------


def prefill_attention(
    q: Any,
    qkv: Any,
    positions: Any,
    page_table: Any,
    k_cache: Any,
    v_cache: Any,
    partial_acc: Any,
    partial_ml: Any,
    out: Any,
    config: PrefillAttentionConfig,
) -> list[Launch]:
    """The two launches of one prefill-attention step for an attention layer (run them in order).

    q: fp32 [R, H, hd] from `qk_norm_rope`; qkv: the fused projection output [R, 2*(H+Hkv)*hd]; positions
    int32 [R, 4] (column 0: cache index); page_table int32 [R, pages]; k_cache/v_cache fp16
    [pages, page_tokens, Hkv, hd] holding every row's K/V already; partial_acc/partial_ml fp32 as
    `partial_buffer_shapes`; out fp32 [R, H*hd] = attention * sigmoid(gate). Device-data assumptions are in
    the module docstring.
    """
    head_dim = check_array(q, "q", np.float32, 3)[2]
    _, page_tokens, num_kv_heads, _ = check_kv_cache(k_cache, v_cache, head_dim)
    caches = (_words(k_cache), _words(v_cache))
    return _launches(q, qkv, positions, page_table, caches, num_kv_heads, page_tokens, FP16_SOURCE,
                     attention_prefill_combine, partial_acc, partial_ml, out, config)  # fmt: skip


def compressed_prefill_attention(
    q: Any,
    qkv: Any,
    positions: Any,
    page_table: Any,
    caches: tuple[Any, ...],
    format_name: str,
    partial_acc: Any,
    partial_ml: Any,
    out: Any,
    config: PrefillAttentionConfig,
) -> list[Launch]:
    """The launches of one prefill-attention step over a compressed cache (run them in order): as
    `prefill_attention`, with caches = (key codes, key scales, value codes, value scales) of the `format_name`
    format (`kv_codes`, written by `kv_write`), attended in the codes' domain as `attention_compressed`: for
    tq3 keys q is first rotated in place (`rotate_queries`), for tq3 values the combine rotates each head's
    output back before the gate."""
    head_dim = check_array(q, "q", np.float32, 3)[2]
    if not caches or len(caches[0].shape) != 4:
        raise ValueError("a compressed cache is 4 arrays [pages, page_tokens, Hkv, n]")
    num_kv_heads = int(caches[0].shape[2])
    _, page_tokens = check_caches(caches, format_name, num_kv_heads, head_dim)
    k_codes, k_scales, v_codes, v_scales = (array.reshape(-1) for array in caches)
    flat = (k_codes.view(np.uint32), k_scales, v_codes.view(np.uint32), v_scales)
    key, value = GPU_FORMATS[format_name]
    combine = attention_prefill_combine_unrotate if value.name == "tq3" else attention_prefill_combine
    launches = _launches(q, qkv, positions, page_table, flat, num_kv_heads, page_tokens, format_name, combine,
                         partial_acc, partial_ml, out, config)  # fmt: skip
    return [rotate_queries_launch(q), *launches] if key.name == "tq3" else launches


def _launches(
    q: Any,
    qkv: Any,
    positions: Any,
    page_table: Any,
    flat_caches: tuple[Any, ...],
    num_kv_heads: int,
    page_tokens: int,
    source: str,
    combine_kernel: Any,
    partial_acc: Any,
    partial_ml: Any,
    out: Any,
    config: PrefillAttentionConfig,
) -> list[Launch]:
    """The partial launch over the `source` cache (its arrays flat) and the `combine_kernel` launch, the
    arguments checked."""
    rows, num_heads, head_dim = check_array(q, "q", np.float32, 3)
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads: need a group of 1..{MAX_GROUP}")
    check_array(positions, "positions", np.int32, 2, (rows, POSITION_COLUMNS))
    table_rows, pages_per_row = check_array(page_table, "page_table", np.int32, 2)
    if table_rows != rows:
        raise ValueError(f"page_table has {table_rows} rows for {rows} query rows")
    check_array(qkv, "qkv", np.float32, 2, (rows, 2 * (num_heads + num_kv_heads) * head_dim))
    acc_shape, ml_shape = partial_buffer_shapes(rows, num_heads, head_dim, config)
    check_array(partial_acc, "partial_acc", np.float32, 4, acc_shape)
    check_array(partial_ml, "partial_ml", np.float32, 4, ml_shape)
    check_array(out, "out", np.float32, 2, (rows, num_heads * head_dim))
    if head_dim % config.qk_dims:
        raise ValueError(f"head size {head_dim} is not a multiple of the config's {config.qk_dims} score dims")
    tile = config.tile_keys
    if page_tokens % tile:
        raise ValueError(f"page_tokens {page_tokens} is not a multiple of the {tile}-key prefill attention tile")
    if pages_per_row * page_tokens >= 2**31:
        raise ValueError("the cache capacity of a row must fit in int32")
    group = num_heads // num_kv_heads
    query_tokens = config.query_tokens(group)
    if config.shared_bytes(group, head_dim) > 48 * 1024:
        raise ValueError(f"config {config} needs more than 48 KB of static shared memory at G={group}, hd={head_dim}")
    tiles = -(-rows // query_tokens)
    if num_kv_heads > MAX_GRID_YZ or rows > MAX_GRID_YZ:
        raise ValueError("too many KV heads or rows for one grid")
    min_split = -(-config.min_split_tokens // tile) * tile
    partial = Launch(
        partial_kernel(group, head_dim, config, source),
        (tiles, num_kv_heads, config.num_splits),
        config.threads,
        (q.reshape(-1), positions, page_table, *flat_caches, np.int32(num_kv_heads), np.int32(page_tokens),
         np.int32(min_split), partial_acc, partial_ml),
    )  # fmt: skip
    combine = Launch(
        combine_kernel,
        (num_heads, rows),
        head_dim,
        (
            partial_acc, partial_ml, qkv, positions, np.int32(pages_per_row * page_tokens), np.int32(query_tokens),
            np.int32(tile), np.int32(min_split), out,
        ),
    )  # fmt: skip
    return [partial, combine]


def causal_fmas(cache_indices: np.ndarray, num_heads: int, head_dim: int) -> int:
    """FMAs attention must do for these rows: per row and head, QK and P.V over its keys 0..index."""
    active = cache_indices[cache_indices >= 0].astype(np.int64)
    return int(2 * num_heads * head_dim * (active + 1).sum())
