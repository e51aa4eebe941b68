"""Q8_0 weight x int8 activation matrix products for many tokens (prefill): a tiled DP4A GEMM.

Same contract as `gemv.py`, whose batched GEMV serves 1..16 tokens (`matmul_kind` says which to use):
y[t, r] = sum over 32-blocks b of dot(Wq[r, b], xq[t, b]) * (ws[r, b] * xs[t, b]), the integer block dots
exact (8 dp4a), each converted to fp32, scaled by the product of the two block scales and summed in fp32
in block order; results agree with float64 to fp32 summation order (tests: 1e-5 of sum_b |term_b|).

Layouts (as `gemv.py`): weight quants int8 [rows, cols] as uint32 words [rows, cols/4], C-contiguous,
16-byte aligned; weight scales fp16 [rows, cols/32]; activation quants uint32 [T, cols/4] (16-byte aligned)
and scales fp32 [T, cols/32] (`quantize.py`); output fp32 [T, rows], or [T, rows/2] for SwiGLU. Modes:
store; accumulate (y += W x); SwiGLU on W = [gate | up] stacked along rows (y = silu(gate x) * (up x)).

Why this shape: prefill does 2 * rows * cols * T ops on rows * cols weight bytes, so from T ~ 64 the CMP
(~17 TOPS dp4a, 818 GB/s) is dp4a-bound; what matters is that dp4a is most of what the SMs issue and that
its operands come from shared memory without bank conflicts. Tensor cores are never used (docs/hardware.md).

Tiling (`GemmTiling`; `GPU_TILING` in brackets; which one a GPU runs is its row of `device_table.py`):
- A block owns [64] weight rows x [64] tokens with [4] warps. Its rows are two halves: consecutive rows in
  store/accumulate mode; in SwiGLU mode [32] gate rows g0.. and their up rows g0 + rows/2.., so each thread
  holds a gate row and its up row and the epilogue needs no exchange.
- Each thread owns 8 rows (rows rg + R*i, i < 8, R the tile's row groups: 4 in each half) x 4 tokens
  (tg + G*j, G its token groups): 32 fp32 accumulators. A warp is 4 row groups x 8 token groups (lane = 8 rg
  + tg); the block's warps tile rows x tokens ([2 x 2]). Token tiles are blockIdx.x, so blocks launched
  together share a weight tile (read from DRAM once, then from L2).
- K advances in stages of [2] 32-value blocks: the block copies its rows' and tokens' int8 words of the
  stage into shared memory (16-byte global loads, a row's stage one contiguous span; 16-byte shared
  stores) with the scales as fp32 beside them, syncs, computes, and syncs again. A thread issues all of a
  stage's global loads before it stores any (one memory latency per stage). [With prefetch] it issues the
  next stage's loads into registers before computing this one, so the latency hides behind the dp4a
  (sm_70 has no cp.async to do that without registers).
- Per 32-block a thread loads its 4 tokens' 8 words (8 16-byte shared loads, held in 32 registers) and
  scales, then per pair of rows their 8 words each (4 16-byte loads) and scales, and runs 8 interleaved
  chains of 8 dp4a, each chain then converted and FMA'd into its accumulator with the scale product: 256
  dp4a next to 24 16-byte and 12 4-byte shared loads, 96 fp32 instructions and ~25 of addressing.
- Bank conflicts: staged rows and tokens have a pitch of stage + 4 words, an odd multiple of 4, so the 8
  lanes of a quarter-warp (one row group, 8 consecutive tokens) read 16 bytes each from 8 distinct bank
  quads, and their weight reads are one address (a broadcast). Scales are staged [block][row or token]
  with a pitch of tile + 32 / stage blocks, conflict-free for the staging stores and the inner reads.
- Registers (ptxas -v; `python -m cmpchat.devtools.ptx_check` for sm_70): the launch bounds ask for [16] warps
  per SM, 128 registers a thread. With prefetch that spills on sm_70 (not on sm_90), so sm_70 runs
  `SM70_TILING`, the same with 12 warps per SM and 168 registers, which holds it without spilling; 11,520
  bytes of static shared memory per block.
Rows, tokens and blocks need not fill the tiles: staging clamps its loads into the operands (what they
bring meets only rows and tokens that are never stored, or blocks never computed); stores are masked.
The simulator runs one Python thread per CUDA thread, so it runs the same body with 1-warp blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import cuda, float32, int32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import SIMULATOR, WARP_SIZE, dp4a, load_u32x4
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.gemv import (
    MAX_TOKENS,
    MODE_ACCUMULATE,
    MODE_SWIGLU,
    check_q8_matmul,
    silu_f32,
)
from cmpchat.kernels.gemv_kquant import (
    FORMATS,
    KQUANT_TYPES,
    ONES,
    KQuantArrays,
    KQuantFormat,
    block_reader,
    check_kquant_matmul,
)
from cmpchat.kernels.quantize import QUANT_BLOCK, VALUES_PER_WORD

WORDS_PER_BLOCK = QUANT_BLOCK // VALUES_PER_WORD  # 8 words per 32-value block
LANE_ROW_GROUPS = 4  # a warp is 4 row groups x 8 token groups
LANE_TOKEN_GROUPS = WARP_SIZE // LANE_ROW_GROUPS
ROWS_PER_HALF = 4  # per thread: 4 rows of each half of the row tile
THREAD_ROWS = 2 * ROWS_PER_HALF
THREAD_TOKENS = 4
THREAD_WORDS = THREAD_TOKENS * WORDS_PER_BLOCK  # activation words a thread holds per 32-block
THREAD_OUTPUTS = THREAD_ROWS * THREAD_TOKENS
MAX_GRID_Y = 65535  # row tiles are blockIdx.y
WARPS_PER_SM = 16
"""Resident warps per SM the register cap is set for: 65536 / (16 * 32) = 128 registers per thread."""
# 16-byte aligned staging lets the compiler merge 4 word accesses into one 16-byte shared load or store
# (the simulator takes no alignment argument).
SHARED_ALIGNMENT = None if SIMULATOR else 16

GEMM_Q8_SIGNATURE = (
    "void(uint32[::1], float16[::1], uint32[::1], float32[::1], float32[::1], int32, int32, int32, int32)"
)
GEMM_KQUANT_SIGNATURE = (
    "void(uint32[::1], uint32[::1], uint16[::1], float16[::1], uint32[::1], float32[::1], float32[::1], "
    "int32, int32, int32, int32, int32, int32)"
)


@dataclass(frozen=True, slots=True)
class GemmTiling:
    """How the GEMM is cut up: the warp grid of a block and the stage depth; everything else follows."""

    warp_rows: int
    """Warps along the weight rows (each 4 row groups of 8 rows: 32 rows)."""
    warp_tokens: int
    """Warps along the tokens (each 8 token groups of 4 tokens: 32 tokens)."""
    stage_blocks: int = 2
    """32-value blocks staged per K step (a power of two)."""
    prefetch: bool = False
    """Load the next stage's operands into registers while this stage computes (costs their registers)."""
    resident_warps: int = WARPS_PER_SM
    """Warps per SM the registers are capped for: 16 leave 128 registers a thread, 12 leave 168."""

    def __post_init__(self) -> None:
        blocks = self.stage_blocks
        if min(self.warp_rows, self.warp_tokens, blocks) < 1 or blocks & (blocks - 1) or blocks > 32:
            raise ValueError(f"bad GEMM tiling {self}")

    @property
    def label(self) -> str:
        """rows x tokens, k the stage blocks, p when prefetching: how benchmarks and tests name it."""
        warps = "" if self.resident_warps == WARPS_PER_SM else f"w{self.resident_warps}"
        return f"{self.tile_rows}x{self.tile_tokens}k{self.stage_blocks}{'p' if self.prefetch else ''}{warps}"

    @property
    def threads(self) -> int:
        return WARP_SIZE * self.warp_rows * self.warp_tokens

    @property
    def row_groups(self) -> int:
        return LANE_ROW_GROUPS * self.warp_rows

    @property
    def token_groups(self) -> int:
        return LANE_TOKEN_GROUPS * self.warp_tokens

    @property
    def tile_rows(self) -> int:
        return THREAD_ROWS * self.row_groups

    @property
    def tile_tokens(self) -> int:
        return THREAD_TOKENS * self.token_groups

    @property
    def stage_words(self) -> int:
        return WORDS_PER_BLOCK * self.stage_blocks

    @property
    def pitch(self) -> int:
        """Words per staged row or token: the stage plus 4 words, an odd multiple of 4 (see the docstring)."""
        return self.stage_words + 4

    @property
    def scale_pad(self) -> int:
        """Staged scales are [block][row or token] with pitch tile + pad: the blocks of a row land in
        different banks when staged (tiles are multiples of 32)."""
        return 0 if self.stage_blocks == 1 else WARP_SIZE // self.stage_blocks

    @property
    def blocks_per_sm(self) -> int:
        """Blocks per SM the kernel's registers are capped for (launch bounds)."""
        return max(1, self.resident_warps // (self.warp_rows * self.warp_tokens))

    def staging_rounds(self) -> tuple[int, int, int, int]:
        """Rounds each thread runs per stage for (weight 16-byte groups, activation 16-byte groups, weight
        scales, activation scales): enough to cover every staged value whatever the block size."""
        groups = self.stage_words // 4
        counts = (self.tile_rows * groups, self.tile_tokens * groups,
                  self.tile_rows * self.stage_blocks, self.tile_tokens * self.stage_blocks)  # fmt: skip
        a, b, c, d = (-(-count // self.threads) for count in counts)
        return a, b, c, d

    def shared_bytes(self) -> int:
        """Static shared memory per block."""
        quants = (self.tile_rows + self.tile_tokens) * self.pitch
        scales = self.stage_blocks * (self.tile_rows + self.tile_tokens + 2 * self.scale_pad)
        return 4 * (quants + scales)


GPU_TILING = GemmTiling(warp_rows=2, warp_tokens=2, stage_blocks=2, prefetch=True)
"""64 rows x 64 tokens, 128 threads, 64 columns per stage, prefetched, 4 blocks per SM: what sm_80 on runs
(`device_table.py`; H200, `gemm_bench --sweep`: 61.0% of the dp4a peak over the 9B projections at 512 tokens,
59.8% with 12 warps, 57.7% without prefetch)."""
SM70_TILING = GemmTiling(warp_rows=2, warp_tokens=2, stage_blocks=2, prefetch=True, resident_warps=12)
"""What the CMP (sm_70) runs: `GPU_TILING` with 168 registers, where 128 spill."""
SWEEP_TILINGS = (
    GPU_TILING,
    SM70_TILING,
    GemmTiling(warp_rows=2, warp_tokens=2, stage_blocks=2),
)
"""What `gemm_bench --sweep` compares; all registered, so the PTX check covers them. Measured and dropped
(H200): stages of 1 block (prefetched or not), 128 x 64 tiles with stages of 4, 64 x 128 tiles, and 64 x 32
tiles, which did not fill more of the GPU at 256 tokens than they lost per block."""
SIMULATOR_TILING = GemmTiling(warp_rows=1, warp_tokens=1, stage_blocks=2, prefetch=True)
"""32 rows x 32 tokens, one warp: the same body, small enough for one Python thread per CUDA thread."""


def matmul_kind(tokens: int) -> str:
    """Which Q8_0 kernel multiplies `tokens` tokens: the batched GEMV up to its 16 (bandwidth-bound there, and
    it pads nothing to a 64-token tile), the GEMM above (either is correct for any count the GEMV takes)."""
    if tokens < 1:
        raise ValueError("no tokens to multiply")
    return "gemv" if tokens <= MAX_TOKENS else "gemm"


@cuda.jit(device=True, inline=True)
def _words4(stage, src):
    """Four consecutive staged words (at a 16-byte aligned uint64 index: one 16-byte shared load)."""
    return stage[src], stage[src + uint64(1)], stage[src + uint64(2)], stage[src + uint64(3)]


def _gemm_body(tiling: GemmTiling, fmt: KQuantFormat | None) -> Any:
    """The GEMM as a device function over Q8_0 weights (fmt None: w_a the quants, w_d the scales) or a
    4/5/6-bit type (w_a..w_d: `gemv_kquant`'s nibbles, high, sub_scales, scales); y[t * out_stride + out_first
    + r]. Both run the same tiles, stages and inner loop; a 4/5/6-bit stage turns each (row, block) into 8 int8
    words and its S (and M, or Q6_K's second S) as it stores the stage, so the inner loop meets int8 words as
    for Q8_0."""
    threads, warp_rows = tiling.threads, tiling.warp_rows
    row_groups, token_groups = tiling.row_groups, tiling.token_groups
    tile_rows, tile_tokens = tiling.tile_rows, tiling.tile_tokens
    half_rows = tile_rows // 2
    stage_blocks, stage_words, pitch = tiling.stage_blocks, tiling.stage_words, tiling.pitch
    groups_per_row = stage_words // 4
    groups_log2 = groups_per_row.bit_length() - 1
    blocks_log2 = stage_blocks.bit_length() - 1
    w_scale_pitch, x_scale_pitch = tile_rows + tiling.scale_pad, tile_tokens + tiling.scale_pad
    w_rounds, x_rounds, ws_rounds, xs_rounds = tiling.staging_rounds()
    w_groups, x_groups = tile_rows * groups_per_row, tile_tokens * groups_per_row
    w_scales, x_scales = tile_rows * stage_blocks, tile_tokens * stage_blocks
    kquant = fmt is not None
    split_scale = fmt is not None and fmt.split_scale
    has_min = fmt is not None and fmt.has_min
    second_scale = split_scale or has_min  # a second fp32 per (row, block): Q6_K's S of values 16..31, or M
    if fmt is not None:
        w_rounds = ws_rounds  # one (row, block) a round: 16 bytes of nibbles, high bits and scales
        read_block, block_words, _ = block_reader(fmt)
    # Shared and local array sizes must be plain constants for Numba.
    w_stage_size, x_stage_size = tile_rows * pitch, tile_tokens * pitch
    w_scale_size, x_scale_size = stage_blocks * w_scale_pitch, stage_blocks * x_scale_pitch
    w_extra_size = w_scale_size if second_scale else 1
    x_sum_size = 2 * x_scale_size if has_min else 1  # sums of each half block of the activations
    w_staged_size, x_staged_size = 4 * w_rounds, 4 * x_rounds
    w_high_size = 2 * w_rounds if kquant else 1
    w_extra_staged_size = w_rounds if second_scale else 1
    prefetch = tiling.prefetch

    @cuda.jit(device=True, inline=True)
    def row_of(local, base_a, base_b):
        return base_a + local if local < half_rows else base_b + local - half_rows

    @cuda.jit(device=True, inline=True)
    def fetch_weights(w_a, w_b, w_c, w_d, w_staged, w_high, ws_staged, w_extra, first_block, base_a, base_b,
                      rows, words, tid):  # fmt: skip
        blocks = words >> 3
        if kquant:
            for r in range(w_rounds):
                g = min(r * threads + tid, w_scales - 1)
                row = min(row_of(g >> blocks_log2, base_a, base_b), rows - 1)
                block = min(first_block + (g & (stage_blocks - 1)), blocks - 1)
                n0, n1, n2, n3, h0, h1, s0, s1, m = read_block(w_a, w_b, w_c, w_d, row, block, blocks)
                w_staged[4 * r], w_staged[4 * r + 1], w_staged[4 * r + 2], w_staged[4 * r + 3] = n0, n1, n2, n3
                w_high[2 * r], w_high[2 * r + 1] = h0, h1
                ws_staged[r] = s0
                if split_scale:
                    w_extra[r] = s1
                elif has_min:
                    w_extra[r] = m
        else:
            first_word = first_block * WORDS_PER_BLOCK
            for r in range(w_rounds):
                g = min(r * threads + tid, w_groups - 1)
                row = min(row_of(g >> groups_log2, base_a, base_b), rows - 1)
                word = first_word + ((g & (groups_per_row - 1)) << 2)
                v0, v1, v2, v3 = load_u32x4(w_a, uint64(row * words + min(word, words - 4)))
                w_staged[4 * r], w_staged[4 * r + 1], w_staged[4 * r + 2], w_staged[4 * r + 3] = v0, v1, v2, v3
            for r in range(ws_rounds):
                g = min(r * threads + tid, w_scales - 1)
                row = min(row_of(g >> blocks_log2, base_a, base_b), rows - 1)
                block = first_block + (g & (stage_blocks - 1))
                ws_staged[r] = float32(w_d[uint64(row * blocks + min(block, blocks - 1))])

    @cuda.jit(device=True, inline=True)
    def fetch_stage(w_a, w_b, w_c, w_d, xq, xs, w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged,
                    first_block, base_a, base_b, token0, rows, words, tokens, tid):  # fmt: skip
        # Every global load of a stage is issued before any is stored, so a stage waits for one memory
        # latency, not one per round, and none is used before the stage is stored (with prefetch, after this
        # stage computes). The loads are unconditional, a load under a branch is not moved past it: indices
        # are clamped into the operands, and what a clamped load brings only meets rows and tokens that are
        # never stored or blocks that are never computed.
        blocks = words >> 3
        fetch_weights(w_a, w_b, w_c, w_d, w_staged, w_high, ws_staged, w_extra, first_block, base_a, base_b,
                      rows, words, tid)  # fmt: skip
        first_word = first_block * WORDS_PER_BLOCK
        for r in range(x_rounds):
            g = min(r * threads + tid, x_groups - 1)
            token = min(token0 + (g >> groups_log2), tokens - 1)
            word = first_word + ((g & (groups_per_row - 1)) << 2)
            v0, v1, v2, v3 = load_u32x4(xq, uint64(token * words + min(word, words - 4)))
            x_staged[4 * r], x_staged[4 * r + 1], x_staged[4 * r + 2], x_staged[4 * r + 3] = v0, v1, v2, v3
        for r in range(xs_rounds):
            g = min(r * threads + tid, x_scales - 1)
            token = min(token0 + (g >> blocks_log2), tokens - 1)
            block = first_block + (g & (stage_blocks - 1))
            xs_staged[r] = xs[uint64(token * blocks + min(block, blocks - 1))]

    @cuda.jit(device=True, inline=True)
    def store_groups(staged, stage, rounds, groups, tid):
        """This thread's fetched 16-byte groups of a stage (`rounds`, `groups`: the tiling's constants) into
        the staged rows of `pitch` words."""
        for r in range(rounds):
            g = r * threads + tid
            if g < groups:
                dst = uint64((g >> groups_log2) * pitch + ((g & (groups_per_row - 1)) << 2))
                stage[dst] = staged[4 * r]
                stage[dst + uint64(1)] = staged[4 * r + 1]
                stage[dst + uint64(2)] = staged[4 * r + 2]
                stage[dst + uint64(3)] = staged[4 * r + 3]

    @cuda.jit(device=True, inline=True)
    def store_blocks(w_staged, w_high, ws_staged, w_extra, stage_w, scale_w, extra_w, tid):
        """This thread's fetched 4/5/6-bit blocks as int8 words in the staged rows, S (and the second field)
        in the staged scales."""
        for r in range(w_rounds):
            g = r * threads + tid
            if g < w_scales:
                block = g & (stage_blocks - 1)
                q0, q1, q2, q3, q4, q5, q6, q7 = block_words(w_staged[4 * r], w_staged[4 * r + 1],
                                                             w_staged[4 * r + 2], w_staged[4 * r + 3],
                                                             w_high[2 * r], w_high[2 * r + 1])  # fmt: skip
                dst = uint64((g >> blocks_log2) * pitch + block * WORDS_PER_BLOCK)
                stage_w[dst], stage_w[dst + uint64(1)], stage_w[dst + uint64(2)], stage_w[dst + uint64(3)] = (
                    q0,
                    q1,
                    q2,
                    q3,
                )
                stage_w[dst + uint64(4)], stage_w[dst + uint64(5)] = q4, q5
                stage_w[dst + uint64(6)], stage_w[dst + uint64(7)] = q6, q7
                at = uint64(block * w_scale_pitch + (g >> blocks_log2))
                scale_w[at] = ws_staged[r]
                if second_scale:
                    extra_w[at] = w_extra[r]

    @cuda.jit(device=True, inline=True)
    def store_stage(w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged, stage_w, stage_x, scale_w, extra_w,
                    scale_x, x_sums, tid):  # fmt: skip
        if kquant:
            store_blocks(w_staged, w_high, ws_staged, w_extra, stage_w, scale_w, extra_w, tid)
        else:
            store_groups(w_staged, stage_w, w_rounds, w_groups, tid)
            for r in range(ws_rounds):
                g = r * threads + tid
                if g < w_scales:
                    scale_w[uint64((g & (stage_blocks - 1)) * w_scale_pitch + (g >> blocks_log2))] = ws_staged[r]
        store_groups(x_staged, stage_x, x_rounds, x_groups, tid)
        if has_min:
            # sum(x) of each half block (a group's 16 values) for the M term, by dp4a against ones.
            for r in range(x_rounds):
                g = r * threads + tid
                if g < x_groups:
                    total = dp4a(x_staged[4 * r], ONES, int32(0))
                    total = dp4a(x_staged[4 * r + 1], ONES, total)
                    total = dp4a(x_staged[4 * r + 2], ONES, total)
                    total = dp4a(x_staged[4 * r + 3], ONES, total)
                    half = g & (groups_per_row - 1)  # the group's place in the stage: block half >> 1, half & 1
                    x_sums[uint64(half * x_scale_pitch + (g >> groups_log2))] = total
        for r in range(xs_rounds):
            g = r * threads + tid
            if g < x_scales:
                scale_x[uint64((g & (stage_blocks - 1)) * x_scale_pitch + (g >> blocks_log2))] = xs_staged[r]

    @cuda.jit(device=True, inline=True)
    def body(w_a, w_b, w_c, w_d, xq, xs, y, rows, words, tokens, mode, out_stride, out_first):
        # Indices are cast to uint64 before indexing: that spares Numba's negative-index wraparound.
        tid = cuda.threadIdx.x
        lane = tid & (WARP_SIZE - 1)
        warp = tid >> 5
        rg = (warp % warp_rows) * LANE_ROW_GROUPS + (lane >> 3)
        tg = (warp // warp_rows) * LANE_TOKEN_GROUPS + (lane & 7)
        token0 = cuda.blockIdx.x * tile_tokens  # token tiles vary fastest: neighbouring blocks share weights
        if mode == MODE_SWIGLU:
            out_rows = rows // 2
            base_a = cuda.blockIdx.y * half_rows
            base_b = base_a + out_rows
        else:
            out_rows = rows
            base_a = cuda.blockIdx.y * tile_rows
            base_b = base_a + half_rows
        blocks = words >> 3

        stage_w = cuda.shared.array(w_stage_size, uint32, alignment=SHARED_ALIGNMENT)
        stage_x = cuda.shared.array(x_stage_size, uint32, alignment=SHARED_ALIGNMENT)
        scale_w = cuda.shared.array(w_scale_size, float32)
        scale_x = cuda.shared.array(x_scale_size, float32)
        extra_w = cuda.shared.array(w_extra_size, float32)
        x_sums = cuda.shared.array(x_sum_size, int32)
        acc = cuda.local.array(THREAD_OUTPUTS, float32)  # acc[4i + j]: row i, token j
        x = cuda.local.array(THREAD_WORDS, uint32)  # x[8j + w]: word w of token j's current block
        x_scale = cuda.local.array(THREAD_TOKENS, float32)
        x_min = cuda.local.array(THREAD_TOKENS, float32)  # xs * sum(x) of token j's block (the M term)
        for i in range(THREAD_OUTPUTS):
            acc[i] = float32(0.0)

        w_staged = cuda.local.array(w_staged_size, uint32)  # this thread's share of a stage, in registers
        w_high = cuda.local.array(w_high_size, uint32)
        x_staged = cuda.local.array(x_staged_size, uint32)
        ws_staged = cuda.local.array(ws_rounds, float32)
        w_extra = cuda.local.array(w_extra_staged_size, float32)
        xs_staged = cuda.local.array(xs_rounds, float32)
        if prefetch:
            fetch_stage(w_a, w_b, w_c, w_d, xq, xs, w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged, 0,
                        base_a, base_b, token0, rows, words, tokens, tid)  # fmt: skip
        for first_block in range(0, blocks, stage_blocks):
            if not prefetch:
                fetch_stage(w_a, w_b, w_c, w_d, xq, xs, w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged,
                            first_block, base_a, base_b, token0, rows, words, tokens, tid)  # fmt: skip
            cuda.syncthreads()  # the previous stage's readers are done
            store_stage(w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged, stage_w, stage_x, scale_w,
                        extra_w, scale_x, x_sums, tid)  # fmt: skip
            cuda.syncthreads()
            if prefetch and first_block + stage_blocks < blocks:
                # The next stage's loads are in flight while this one computes.
                fetch_stage(w_a, w_b, w_c, w_d, xq, xs, w_staged, w_high, ws_staged, w_extra, x_staged, xs_staged,
                            first_block + stage_blocks, base_a, base_b, token0, rows, words, tokens, tid)  # fmt: skip

            for block in range(min(stage_blocks, blocks - first_block)):
                for j in range(THREAD_TOKENS):
                    token = tg + token_groups * j
                    src = uint64(token * pitch + block * WORDS_PER_BLOCK)
                    for w in range(WORDS_PER_BLOCK):
                        x[WORDS_PER_BLOCK * j + w] = stage_x[src + uint64(w)]
                    x_scale[j] = scale_x[uint64(block * x_scale_pitch + token)]
                    if has_min:
                        halves = x_sums[uint64(2 * block * x_scale_pitch + token)]
                        halves += x_sums[uint64((2 * block + 1) * x_scale_pitch + token)]
                        x_min[j] = x_scale[j] * float32(halves)
                for pair in range(THREAD_ROWS // 2):
                    # Two rows at a time: eight independent dp4a chains hide the dp4a latency.
                    i, n = 2 * pair, 2 * pair + 1
                    src_i = uint64((rg + row_groups * i) * pitch + block * WORDS_PER_BLOCK)
                    src_n = uint64((rg + row_groups * n) * pitch + block * WORDS_PER_BLOCK)
                    a0, a1, a2, a3 = _words4(stage_w, src_i)
                    a4, a5, a6, a7 = _words4(stage_w, src_i + uint64(4))
                    b0, b1, b2, b3 = _words4(stage_w, src_n)
                    b4, b5, b6, b7 = _words4(stage_w, src_n + uint64(4))
                    at_i = uint64(block * w_scale_pitch + rg + row_groups * i)
                    at_n = uint64(block * w_scale_pitch + rg + row_groups * n)
                    scale_i, scale_n = scale_w[at_i], scale_w[at_n]
                    extra_i = extra_n = float32(0.0)
                    if second_scale:
                        extra_i, extra_n = extra_w[at_i], extra_w[at_n]
                    for j in range(THREAD_TOKENS):
                        k = WORDS_PER_BLOCK * j
                        low_i = dp4a(a0, x[k], int32(0))
                        low_n = dp4a(b0, x[k], int32(0))
                        low_i = dp4a(a1, x[k + 1], low_i)
                        low_n = dp4a(b1, x[k + 1], low_n)
                        low_i = dp4a(a2, x[k + 2], low_i)
                        low_n = dp4a(b2, x[k + 2], low_n)
                        low_i = dp4a(a3, x[k + 3], low_i)
                        low_n = dp4a(b3, x[k + 3], low_n)
                        if split_scale:  # values 16..31 have their own scale: a second chain
                            high_i = dp4a(a4, x[k + 4], int32(0))
                            high_n = dp4a(b4, x[k + 4], int32(0))
                        else:
                            high_i = dp4a(a4, x[k + 4], low_i)
                            high_n = dp4a(b4, x[k + 4], low_n)
                        high_i = dp4a(a5, x[k + 5], high_i)
                        high_n = dp4a(b5, x[k + 5], high_n)
                        high_i = dp4a(a6, x[k + 6], high_i)
                        high_n = dp4a(b6, x[k + 6], high_n)
                        high_i = dp4a(a7, x[k + 7], high_i)
                        high_n = dp4a(b7, x[k + 7], high_n)
                        if split_scale:
                            term_i = float32(low_i) * (scale_i * x_scale[j]) + float32(high_i) * (extra_i * x_scale[j])
                            term_n = float32(low_n) * (scale_n * x_scale[j]) + float32(high_n) * (extra_n * x_scale[j])
                        else:
                            term_i = float32(high_i) * (scale_i * x_scale[j])
                            term_n = float32(high_n) * (scale_n * x_scale[j])
                            if has_min:
                                term_i += extra_i * x_min[j]
                                term_n += extra_n * x_min[j]
                        acc[THREAD_TOKENS * i + j] += term_i
                        acc[THREAD_TOKENS * n + j] += term_n

        for j in range(THREAD_TOKENS):
            token = token0 + tg + token_groups * j
            if token < tokens:
                out = token * out_stride + out_first
                for i in range(ROWS_PER_HALF):
                    row = base_a + rg + row_groups * i
                    if mode == MODE_SWIGLU:
                        if row < out_rows:
                            gate = acc[THREAD_TOKENS * i + j]
                            up = acc[THREAD_TOKENS * (i + ROWS_PER_HALF) + j]
                            y[uint64(out + row)] = silu_f32(gate) * up
                    else:
                        for half in range(2):
                            r = row + half * half_rows
                            if r < rows:
                                value = acc[THREAD_TOKENS * (i + half * ROWS_PER_HALF) + j]
                                if mode == MODE_ACCUMULATE:
                                    y[uint64(out + r)] += value
                                else:
                                    y[uint64(out + r)] = value

    return body


def _make_gemm(tiling: GemmTiling, tensor_type: T) -> Any:
    """The kernel of one weight type (Q8_0 or `gemv_kquant.FORMATS`) and tiling."""
    name = f"gemm_{'q8' if tensor_type == T.Q8_0 else tensor_type.name.lower()}_" + tiling.label.replace("x", "_")
    # ptxas keeps to the registers that let `blocks_per_sm` blocks share an SM (128 at 16 warps per SM).
    compile_kernel = kernel(GEMM_Q8_SIGNATURE if tensor_type == T.Q8_0 else GEMM_KQUANT_SIGNATURE,
                            launch_bounds=(tiling.threads, tiling.blocks_per_sm))  # fmt: skip
    if tensor_type == T.Q8_0:
        body = _gemm_body(tiling, None)

        def gemm_q8(wq, ws, xq, xs, y, rows, words, tokens, mode):
            body(wq, wq, wq, ws, xq, xs, y, rows, words, tokens, mode, rows // 2 if mode == MODE_SWIGLU else rows, 0)

        gemm_q8.__name__ = gemm_q8.__qualname__ = name
        return compile_kernel(gemm_q8)
    body = _gemm_body(tiling, FORMATS[tensor_type])

    def gemm_kquant(nibbles, high, sub_scales, scales, xq, xs, y, rows, words, tokens, mode, out_stride, out_first):
        body(nibbles, high, sub_scales, scales, xq, xs, y, rows, words, tokens, mode, out_stride, out_first)

    gemm_kquant.__name__ = gemm_kquant.__qualname__ = name
    return compile_kernel(gemm_kquant)


_KERNELS: dict[tuple[GemmTiling, T], Any] = {}


def gemm_kernel(tiling: GemmTiling, tensor_type: T = T.Q8_0) -> Any:
    """The kernel for a tiling and weight type, defined once (the first call registers it for the PTX check)."""
    if (tiling, tensor_type) not in _KERNELS:
        _KERNELS[(tiling, tensor_type)] = _make_gemm(tiling, tensor_type)
    return _KERNELS[(tiling, tensor_type)]


for _tiling in (SIMULATOR_TILING,) if SIMULATOR else SWEEP_TILINGS:
    gemm_kernel(_tiling)
for _tiling in (SIMULATOR_TILING,) if SIMULATOR else (GPU_TILING, SM70_TILING):
    for _type in KQUANT_TYPES:
        gemm_kernel(_tiling, _type)
del _tiling, _type


# ---------------------------------------------------------------------------------------------- host side


def gemm_grid(rows: int, tokens: int, mode: str, tiling: GemmTiling) -> tuple[int, int]:
    """(token tiles, row tiles): the launch grid for a weight of `rows` rows and `tokens` tokens."""
    out_rows = rows // 2 if mode == "swiglu" else rows
    row_tile = tiling.tile_rows // 2 if mode == "swiglu" else tiling.tile_rows
    return -(-tokens // tiling.tile_tokens), -(-out_rows // row_tile)


def gemm_q8_launch(
    weight_quants: Any,
    weight_scales: Any,
    x_quants: Any,
    x_scales: Any,
    out: Any,
    *,
    mode: str = "store",
    tiling: GemmTiling,
) -> Launch:
    """y = W x for any number of quantised tokens (layouts in the module docstring; best above 16 tokens,
    see `matmul_kind`).

    mode "store" writes out [T, rows]; "accumulate" adds into it; "swiglu" takes W = [gate | up] stacked
    along rows and writes silu(gate x) * (up x) into out [T, rows/2]. `tiling`: the device's
    (`DeviceTuning.gemm`), or another for benchmarks and tests.
    """
    rows, words, tokens, code = check_q8_matmul(weight_quants, weight_scales, x_quants, x_scales, out, mode)
    grid = gemm_grid(rows, tokens, mode, tiling)
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"{rows} rows need {grid[1]} row tiles, more than a grid's {MAX_GRID_Y}: split the weight")
    args = (
        weight_quants.reshape(-1), weight_scales.reshape(-1), x_quants.reshape(-1), x_scales.reshape(-1),
        out.reshape(-1), np.int32(rows), np.int32(words), np.int32(tokens), np.int32(code),
    )  # fmt: skip
    return Launch(gemm_kernel(tiling), grid, tiling.threads, args)


def gemm_kquant_launch(
    tensor_type: T,
    arrays: KQuantArrays,
    cols: int,
    x_quants: Any,
    x_scales: Any,
    out: Any,
    *,
    mode: str = "store",
    out_first: int = 0,
    tiling: GemmTiling,
) -> Launch:
    """y = W x for a 4/5/6-bit W (`gemv_kquant`'s layout and contract, `out_first` included: a part of a
    fused matrix writes its columns of a wider output), tiled as `tiling` says; best above 16 tokens."""
    rows, tokens, code, out_stride = check_kquant_matmul(tensor_type, arrays, cols, x_quants, x_scales, out, mode,
                                                         out_first)  # fmt: skip
    grid = gemm_grid(rows, tokens, mode, tiling)
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"{rows} rows need {grid[1]} row tiles, more than a grid's {MAX_GRID_Y}: split the weight")
    args = (
        arrays.nibbles.reshape(-1), arrays.high.reshape(-1), arrays.sub_scales.reshape(-1), arrays.scales.reshape(-1),
        x_quants.reshape(-1), x_scales.reshape(-1), out.reshape(-1), np.int32(rows), np.int32(cols // 4),
        np.int32(tokens), np.int32(code), np.int32(out_stride), np.int32(out_first),
    )  # fmt: skip
    return Launch(gemm_kernel(tiling, tensor_type), grid, tiling.threads, args)
