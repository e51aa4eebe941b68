"""Q8_0 weight x int8 activation matrix-vector products for 1..16 tokens (decode, small batches).

y[t, r] = sum over 32-blocks b of dot(Wq[r, b], xq[t, b]) * (ws[r, b] * xs[t, b]), as the reference
`Linear` int8 path: integer block dots are exact (dp4a), each scaled in fp32 and summed in fp32 in another
order than numpy's, so results agree to fp32 summation order: |error| <= ~1e-6 * sum_b |term_b| (tests
use 1e-5 of that sum).

Layouts (the backend repacks each GGUF Q8_0 matrix once at load, see `repack_q8_0`):
- weight quants: int8 [rows, cols] passed as uint32 words [rows, cols/4], C-contiguous, 16-byte aligned;
- weight scales: fp16 [rows, cols/32] (numpy float16; the GGUF block scale as is);
- activations: quants uint32 [T, cols/4] and scales fp32 [T, cols/32] (`quantize.py`), 16-byte aligned;
- output fp32 [T, rows], or [T, rows/2] for SwiGLU.
Projections that share an input are concatenated along rows at load (q|k|v; GDN qkv|gate|beta|alpha;
ffn gate|up) so one launch reads the input once. Epilogues (`mode`): store; accumulate (y += W x: the
residual add after attn_output / ssm_out / ffn_down); SwiGLU on a [gate | up] weight (y = silu(g) * u).

Tiling, for bandwidth (decode streams every weight byte exactly once; nothing else matters as much):
- A warp owns two rows (SwiGLU: gate row r and up row r + rows/2, so the epilogue needs no exchange) and
  walks them in steps of 512 bytes per row: lane l loads 16 bytes at byte 16*l of the step (`load_u32x4`,
  ld.global.nc.v4), so every warp load is one fully used, contiguous 512-byte span. Two steps per loop
  iteration give each lane 4 independent 16-byte loads in flight (2 KB per warp); the fp16 weight scales
  of a step are one 32-byte sector per row, each byte used. Nothing else comes from DRAM.
- A block of 8 warps (16 rows) stages the activations of all T tokens in shared memory once per chunk of
  columns, so each activation byte comes from L2 once per 16 weight rows, not once per row. A chunk is
  1024 words (4096 columns) per token for T <= 4 and 16 KB in all for more tokens (+1/8 for scales), so
  shared memory never limits occupancy; registers do (ptxas for sm_70: 68 at T=1, 92-154 above), giving 2-3
  blocks per SM: 16-24 warps x 2 KB in flight, several times what Little's law asks at 818 GB/s (~7 KB
  per SM). Within each 128-word step the staged words are transposed (word 4l+c lives at 32c+l), so the
  four 32-bit shared loads of a lane are conflict-free instead of 4-way conflicted.
- Per 16-byte half-block and token: 4 dp4a, then one int->fp32 conversion and one FMA with the product of
  the two block scales. T is a compile-time constant per launch (buckets 1, 2, 4, 8, 16; unused token slots
  hold zero activations) so the per-token accumulators are registers, not local memory.
- The 2T partial sums of each lane are reduce-scattered over the warp (2T - 1 shuffles, then a butterfly
  on the last value: 5 shuffles at T=1, 31 at T=16 instead of 160), which leaves one finished sum per
  lane group; those lanes store (y += for the residual, silu(g) * u for SwiGLU after one more shuffle).
At T >= 8 the CMP becomes dp4a-bound (~17 TOPS against 818 GB/s), which this layout cannot change.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    SIMULATOR,
    WARP_SIZE,
    allow_dependent_grids,
    dp4a,
    load_u32x4,
    shfl_xor_f32,
    wait_for_prior_grids,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.quantize import QUANT_BLOCK, VALUES_PER_WORD, check_quantized
from cmpchat.model.quant import q8_0_split

TOKEN_BUCKETS = (1, 2, 4, 8, 16)
MAX_TOKENS = TOKEN_BUCKETS[-1]
# 8 warps (16 rows) per block on a GPU; the simulator runs one Python thread per CUDA thread and every
# shuffle is a block-wide barrier there, so it runs the same body with 2 warps per block.
WARPS_PER_BLOCK = 2 if SIMULATOR else 8
BLOCK_THREADS = WARPS_PER_BLOCK * WARP_SIZE
ROWS_PER_WARP = 2
STEP_WORDS = 128  # 32 lanes x 4 words: one 512-byte step of a row
UNROLL = 2  # steps per loop iteration
STAGE_WORDS_TARGET = 4096  # staged activation words per block (16 KB) when T is large
MAX_CHUNK_WORDS = 1024  # and at most this many per token: longer chunks cost T=1 registers (staging unrolls)
WORDS_PER_BLOCK = QUANT_BLOCK // VALUES_PER_WORD  # 8 words per 32-value block
LOAD_BATCH = 4
"""16-byte activation loads a thread issues before storing any when staging a chunk (from 8 tokens: one L2
latency per chunk instead of one per round; H200, all of a 9B / 27B step's projections: 4% / 9% faster at 8
tokens, 7% / 12% at 16, ffn down 24-31%)."""

# Unsigned offsets for unsigned shared-memory indices (an unsigned plus a Python int would be a float).
U16, U32, U64, U96, U128 = (np.uint64(n) for n in (16, 32, 64, 96, 128))

MODE_STORE = 0
MODE_ACCUMULATE = 1
MODE_SWIGLU = 2
MODES = {"store": MODE_STORE, "accumulate": MODE_ACCUMULATE, "swiglu": MODE_SWIGLU}

GEMV_Q8_SIGNATURE = (
    "void(uint32[::1], float16[::1], uint32[::1], float32[::1], float32[::1], int32, int32, int32, int32)"
)


def chunk_words(tokens: int) -> int:
    """Activation words per token staged at once for a token bucket (a multiple of UNROLL * STEP_WORDS)."""
    return max(UNROLL * STEP_WORDS, min(MAX_CHUNK_WORDS, STAGE_WORDS_TARGET // tokens))


def staging_rounds(tokens: int, threads: int) -> tuple[int, int]:
    """Rounds of (16-byte activation groups, activation scales) each thread stages per chunk: every staged
    value is covered even when a block has more threads than there are values (T=1 has 128 scales)."""
    stage_words = tokens * chunk_words(tokens)
    return -(-(stage_words // 4) // threads), -(-(stage_words // WORDS_PER_BLOCK) // threads)


def token_bucket(tokens: int) -> int:
    """The compiled token count a launch for `tokens` tokens uses."""
    if tokens < 1:
        raise ValueError("no tokens to multiply")
    for bucket in TOKEN_BUCKETS:
        if tokens <= bucket:
            return bucket
    raise ValueError(f"the GEMV takes 1..{MAX_TOKENS} tokens per launch, got {tokens}; split the batch")


@cuda.jit(device=True, inline=True)
def silu_f32(g):
    return g / (float32(1.0) + math.exp(-g))


@cuda.jit(device=True, inline=True)
def staged_index(word):
    """Where word `word` of a staged row lives in shared memory: within each 128-word step, word 4l+c at 32c+l
    (the four 32-bit shared loads of a lane are then conflict-free)."""
    offset = word & (STEP_WORDS - 1)
    return (word & ~(STEP_WORDS - 1)) + (offset >> 2) + ((offset & 3) << 5)


@cuda.jit(device=True, inline=True)
def pair_rows(pair, rows, mode):
    """The two weight rows a warp reads, the output rows they feed, and the output width."""
    if mode == MODE_SWIGLU:
        out_rows = rows // 2
        return pair, pair + out_rows, out_rows
    return 2 * pair, 2 * pair + 1, rows


@cuda.jit(device=True, inline=True)
def fold(values, lane, offset, live):
    """One level of a warp reduce-scatter of the first `live` values of each lane (offset, live: constants).

    With several values live, lanes with the `offset` bit set keep the upper half and send the lower half
    to their partner, which keeps the lower half: afterwards each lane holds half as many values, each
    summed over both lanes. With one value left this is a plain butterfly step. Every lane of the block
    must call it (the simulator's shuffles are block barriers).
    """
    if live > 1:
        half = live // 2
        upper = (lane & offset) != 0
        for i in range(half):
            low = values[i]
            high = values[i + half]
            values[i] = (high if upper else low) + shfl_xor_f32(low if upper else high, offset)
    else:
        values[0] += shfl_xor_f32(values[0], offset)


def _make_gemv_q8(tokens_max: int) -> Any:
    chunk = chunk_words(tokens_max)
    stage_words = tokens_max * chunk
    stage_scales = stage_words // WORDS_PER_BLOCK
    stage_groups = stage_words // 4  # 16-byte groups staged per chunk
    group_rounds, scale_rounds = staging_rounds(tokens_max, BLOCK_THREADS)
    # From 8 tokens the chunk's loads go out in batches; below, that form of the staging costs the H200 a
    # block per SM (T=4: 92-118 registers against 78) and gains nothing (T=2), so each round loads, then stores.
    stage_in_batches = tokens_max >= 8
    load_batch = LOAD_BATCH if group_rounds % LOAD_BATCH == 0 else 1
    staged_words = 4 * load_batch  # a plain constant for Numba's local array
    chunk_groups_log2 = (chunk // 4).bit_length() - 1
    chunk_blocks_log2 = (chunk // WORDS_PER_BLOCK).bit_length() - 1
    iteration_words = UNROLL * STEP_WORDS
    sums = ROWS_PER_WARP * tokens_max  # partial sums per lane: a power of two, 2..32
    spread = 5 - (sums.bit_length() - 1)  # lanes per reduced sum = 2^spread
    live_16, live_8, live_4, live_2, live_1 = (max(sums >> level, 1) for level in range(5))

    def gemv_q8(wq, ws, xq, xs, y, rows, words, tokens, mode):
        wait_for_prior_grids()
        allow_dependent_grids()
        # Index arithmetic note: powers of two use shifts and masks (Python's floor division on signed
        # integers costs several instructions each), and array indices are cast to uint64, which spares
        # Numba's negative-index wraparound on every access of the inner loop.
        tid = cuda.threadIdx.x
        lane = tid & (WARP_SIZE - 1)
        pair = cuda.blockIdx.x * WARPS_PER_BLOCK + (tid >> 5)
        row_a, row_b, out_rows = pair_rows(pair, rows, mode)
        live_a = row_a < out_rows if mode == MODE_SWIGLU else row_a < rows
        # Dead rows read a live row (clamped) instead of branching: every warp reaches the barriers.
        blocks = words >> 3
        quants_a = min(row_a, rows - 1) * words
        quants_b = min(row_b, rows - 1) * words
        scales_a = min(row_a, rows - 1) * blocks
        scales_b = min(row_b, rows - 1) * blocks

        acc = cuda.local.array(sums, float32)  # acc[2t] row a, acc[2t + 1] row b, token t
        for i in range(sums):
            acc[i] = float32(0.0)
        stage_q = cuda.shared.array(stage_words, uint32)
        stage_s = cuda.shared.array(stage_scales, float32)

        staged_q = cuda.local.array(staged_words, uint32)  # a batch of this thread's share of a chunk
        staged_s = cuda.local.array(scale_rounds, float32)
        for start in range(0, words, chunk):
            if stage_in_batches:
                # The chunk's loads are issued LOAD_BATCH rounds at a time before any is stored (one L2 latency
                # per batch, not one per round): indices clamped into x, out-of-range values zeroed when stored.
                for i in range(scale_rounds):
                    g = min(i * BLOCK_THREADS + tid, stage_scales - 1)
                    t = min(g >> chunk_blocks_log2, tokens - 1)
                    block = min((start >> 3) + (g & ((1 << chunk_blocks_log2) - 1)), blocks - 1)
                    staged_s[i] = xs[uint64(t * blocks + block)]
                if start > 0:
                    cuda.syncthreads()  # the previous chunk's readers are done
                for first in range(0, group_rounds, load_batch):
                    for n in range(load_batch):
                        g = min((first + n) * BLOCK_THREADS + tid, stage_groups - 1)
                        t = min(g >> chunk_groups_log2, tokens - 1)
                        offset = min(start + ((g & ((1 << chunk_groups_log2) - 1)) << 2), words - 4)
                        v0, v1, v2, v3 = load_u32x4(xq, uint64(t * words + offset))
                        staged_q[4 * n], staged_q[4 * n + 1], staged_q[4 * n + 2], staged_q[4 * n + 3] = v0, v1, v2, v3
                    for n in range(load_batch):
                        g = (first + n) * BLOCK_THREADS + tid
                        t = g >> chunk_groups_log2
                        offset = (g & ((1 << chunk_groups_log2) - 1)) << 2  # word offset within the chunk
                        if g < stage_groups:
                            keep = t < tokens and start + offset < words
                            dst = t * chunk + staged_index(offset)
                            stage_q[uint64(dst)] = staged_q[4 * n] if keep else uint32(0)
                            stage_q[uint64(dst + 32)] = staged_q[4 * n + 1] if keep else uint32(0)
                            stage_q[uint64(dst + 64)] = staged_q[4 * n + 2] if keep else uint32(0)
                            stage_q[uint64(dst + 96)] = staged_q[4 * n + 3] if keep else uint32(0)
                for i in range(scale_rounds):
                    g = i * BLOCK_THREADS + tid
                    if g < stage_scales:
                        t = g >> chunk_blocks_log2
                        block = (start >> 3) + (g & ((1 << chunk_blocks_log2) - 1))
                        stage_s[uint64(g)] = staged_s[i] if t < tokens and block < blocks else float32(0.0)
                cuda.syncthreads()
            else:
                cuda.syncthreads()  # the previous chunk's readers are done
                for i in range(group_rounds):
                    g = i * BLOCK_THREADS + tid
                    if g >= stage_groups:
                        break
                    t = g >> chunk_groups_log2
                    offset = (g & ((1 << chunk_groups_log2) - 1)) << 2  # word offset within the chunk
                    v0 = v1 = v2 = v3 = uint32(0)
                    if t < tokens and start + offset < words:
                        v0, v1, v2, v3 = load_u32x4(xq, uint64(t * words + start + offset))
                    dst = t * chunk + staged_index(offset)
                    stage_q[uint64(dst)] = v0
                    stage_q[uint64(dst + 32)] = v1
                    stage_q[uint64(dst + 64)] = v2
                    stage_q[uint64(dst + 96)] = v3
                for i in range(scale_rounds):
                    g = i * BLOCK_THREADS + tid
                    if g >= stage_scales:
                        break
                    t = g >> chunk_blocks_log2
                    block = (start >> 3) + (g & ((1 << chunk_blocks_log2) - 1))
                    scale = float32(0.0)
                    if t < tokens and block < blocks:
                        scale = xs[uint64(t * blocks + block)]
                    stage_s[uint64(g)] = scale
                cuda.syncthreads()

            for step in range(0, min(chunk, words - start), iteration_words):
                k0 = start + step + 4 * lane  # this lane's first word in each row, first step
                k1 = k0 + STEP_WORDS  # second step
                # All loads first (4 x 16 B per lane in flight), zeros past the row end.
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
                for t in range(tokens_max):
                    q = uint64(t * chunk + step + lane)
                    s = uint64(t * (chunk >> 3) + ((step + 4 * lane) >> 3))
                    x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
                    xs0 = stage_s[s]
                    dot_a = dp4a(a3, x3, dp4a(a2, x2, dp4a(a1, x1, dp4a(a0, x0, 0))))
                    dot_b = dp4a(b3, x3, dp4a(b2, x2, dp4a(b1, x1, dp4a(b0, x0, 0))))
                    acc[2 * t] += float32(dot_a) * (sa0 * xs0)
                    acc[2 * t + 1] += float32(dot_b) * (sb0 * xs0)
                    q += U128
                    x0, x1, x2, x3 = stage_q[q], stage_q[q + U32], stage_q[q + U64], stage_q[q + U96]
                    xs1 = stage_s[s + U16]
                    dot_a = dp4a(c3, x3, dp4a(c2, x2, dp4a(c1, x1, dp4a(c0, x0, 0))))
                    dot_b = dp4a(d3, x3, dp4a(d2, x2, dp4a(d1, x1, dp4a(d0, x0, 0))))
                    acc[2 * t] += float32(dot_a) * (sa1 * xs1)
                    acc[2 * t + 1] += float32(dot_b) * (sb1 * xs1)

        # Reduce-scatter the 2T partial sums over the warp: 2T - 1 shuffles (then 5 - log2(2T) more for
        # the last value) instead of 5 per sum; afterwards lane l holds sum number l >> spread.
        fold(acc, lane, 16, live_16)
        fold(acc, lane, 8, live_8)
        fold(acc, lane, 4, live_4)
        fold(acc, lane, 2, live_2)
        fold(acc, lane, 1, live_1)
        total = acc[0]
        partner = shfl_xor_f32(total, 1 << spread)  # the other row of the pair, same token (SwiGLU)
        index = lane >> spread
        t = index >> 1
        if (lane & ((1 << spread) - 1)) == 0 and t < tokens:
            out = t * out_rows
            if mode == MODE_SWIGLU:
                if (index & 1) == 0 and live_a:
                    y[uint64(out + row_a)] = silu_f32(total) * partner
            else:
                row = row_a if (index & 1) == 0 else row_b
                if row_a < rows and row < rows:  # live_a, live_b in store/accumulate modes
                    if mode == MODE_ACCUMULATE:
                        y[uint64(out + row)] += total
                    else:
                        y[uint64(out + row)] = total

    gemv_q8.__name__ = gemv_q8.__qualname__ = f"gemv_q8_t{tokens_max}"
    return kernel(GEMV_Q8_SIGNATURE, early_launch=True)(gemv_q8)


GEMV_Q8 = {tokens: _make_gemv_q8(tokens) for tokens in TOKEN_BUCKETS}


# ---------------------------------------------------------------------------------------------- host side


def repack_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 matrix's bytes as the GEMV's (quants uint32 [rows, cols/4], scales fp16 [rows, cols/32])."""
    if cols % QUANT_BLOCK:
        raise ValueError(f"Q8_0 rows hold whole blocks of {QUANT_BLOCK}, got {cols} columns")
    scales, quants = q8_0_split(raw, rows, cols)
    words = np.ascontiguousarray(quants).reshape(rows, cols).view(np.uint32)
    return words, np.ascontiguousarray(scales)


def output_shape(rows: int, tokens: int, mode: str) -> tuple[int, int]:
    """The output a launch writes: [T, rows], or [T, rows/2] for SwiGLU."""
    return (tokens, rows // 2) if mode == "swiglu" else (tokens, rows)


def row_pairs(rows: int, mode: str) -> int:
    """Row pairs a launch deals out (`pair_rows`): (gate, up) pairs for SwiGLU, else neighbours (the last one
    may be alone)."""
    return rows // 2 if mode == "swiglu" else (rows + 1) // 2


def check_aligned(array: Any, name: str, alignment: int = 16) -> None:
    """16-byte loads need 16-byte aligned rows; device allocations are, offset views may not be."""
    interface = getattr(array, "__cuda_array_interface__", None)
    address = interface["data"][0] if interface is not None else array.__array_interface__["data"][0]
    if address % alignment:
        raise ValueError(f"{name} must start on a {alignment}-byte boundary (address {address:#x})")


def check_mode(mode: str, rows: int) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "swiglu" and rows % 2:
        raise ValueError(f"a SwiGLU weight stacks gate and up rows: need an even row count, got {rows}")
    return MODES[mode]


def gemv_q8_launch(
    weight_quants: Any,
    weight_scales: Any,
    x_quants: Any,
    x_scales: Any,
    out: Any,
    *,
    mode: str = "store",
) -> Launch:
    """y = W x for T <= 16 quantised tokens (layouts in the module docstring).

    mode "store" writes out [T, rows]; "accumulate" adds into it; "swiglu" takes W = [gate | up] stacked
    along rows and writes silu(gate x) * (up x) into out [T, rows/2].
    """
    rows, words, tokens, code = check_q8_matmul(weight_quants, weight_scales, x_quants, x_scales, out, mode)
    bucket = token_bucket(tokens)
    grid = (row_pairs(rows, mode) + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    args = (
        weight_quants.reshape(-1), weight_scales.reshape(-1), x_quants.reshape(-1), x_scales.reshape(-1),
        out.reshape(-1), np.int32(rows), np.int32(words), np.int32(tokens), np.int32(code),
    )  # fmt: skip
    return Launch(GEMV_Q8[bucket], grid, BLOCK_THREADS, args)


def check_q8_matmul(
    weight_quants: Any, weight_scales: Any, x_quants: Any, x_scales: Any, out: Any, mode: str
) -> tuple[int, int, int, int]:
    """Check the operands of a Q8_0 weight x int8 activations product (layouts in the module docstring),
    as the GEMV and GEMM launchers take them; (rows, words per row, tokens, mode code)."""
    rows, words = check_array(weight_quants, "weight quants", np.uint32, 2)
    cols = words * VALUES_PER_WORD
    if rows == 0 or cols % QUANT_BLOCK or cols == 0:
        raise ValueError(
            f"weight quants must be [rows, cols/4] with cols a multiple of {QUANT_BLOCK}, got {(rows, words)}"
        )
    check_array(weight_scales, "weight scales", np.float16, 2, (rows, cols // QUANT_BLOCK))
    tokens = int(x_quants.shape[0]) if len(x_quants.shape) == 2 else 0
    if tokens < 1:
        raise ValueError("no tokens to multiply")
    check_quantized(x_quants, x_scales, tokens, cols)
    code = check_mode(mode, rows)
    check_array(out, "out", np.float32, 2, output_shape(rows, tokens, mode))
    for array, name in ((weight_quants, "weight quants"), (x_quants, "activation quants")):
        check_aligned(array, name)
    return rows, words, tokens, code


def weight_bytes(rows: int, cols: int) -> int:
    """Bytes of one Q8_0 matrix as the GEMV reads it (quants + fp16 scales)."""
    return rows * cols + rows * (cols // QUANT_BLOCK) * 2
