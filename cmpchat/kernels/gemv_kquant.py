"""4/5/6-bit weight (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) x int8 activation matrix products.

Every one of these types stores a weight as w = S * q + M per 32 values (Q6_K: S per 16), q a small unsigned
integer, S and M made from fp16 fields and small integer sub-block scales (`cmpchat/model/dequant.py`):

| type | S | M | q |
|---|---|---|---|
| Q4_0 / Q5_0 | d | 0 | q - 8 / q - 16 |
| Q4_1 / Q5_1 | d | m | q |
| Q4_K / Q5_K | d * sc | -(dmin * m) | q |
| Q6_K | d * sc (per 16) | 0 | q - 32 |

so y[t, r] = sum over 32-blocks b of xs[t, b] * (S * dot(q, xq[t, b]) + M * sum(xq[t, b])), the integer dots
exact (dp4a), S and M computed in the kernel exactly as the reader computes them (each product of an fp16 and
a small integer is exact in fp32). Results equal dequantise-then-multiply to fp32 summation order: |error| <=
~1e-6 * sum_b (|S dot| + |M sum|) xs (tests use 1e-5 of that sum).

GPU layout (`backends/gpu/repack.py` builds it from the file's blocks, row-major, each row's bytes contiguous):
- nibbles: uint32 [rows, cols/8]: per 32-block 16 bytes, byte i = low 4 bits of value i | of value i+16 << 4,
  so word c's low nibbles are values 4c..4c+3 and its high nibbles 16+4c.., each an int8 word after one mask;
- high: uint32 [rows, cols/32 * high_bits] (Q5: 1 word a block, bit 8i + w the 5th bit of value 4w + i;
  Q6_K: 2 words, word w // 4 bits 8i + 2 (w % 4) the top 2 bits of value 4w + i), so one shift and mask
  puts the high bits of int8 word w in place;
- sub_scales: uint16 [rows, cols/32] (k-quants: Q4_K / Q5_K sc | m << 8, Q6_K the two int8 scales of the
  block's halves);
- scales: fp16 [rows, groups * fields]: per group of 256 (k-quants) or 32 values the file's d (and dmin or m).
Types without one of them get a [1, 1] placeholder. Activations as `gemv.py`'s: quants uint32 [T, cols/4] and
scales fp32 [T, cols/32] (`quantize.py`).

Tiling (the Q8_0 GEMV's, `gemv.py`, with one 32-value block per lane): a warp owns two rows (SwiGLU: gate row
r and up row r + rows/2) and walks them 32 blocks at a time, lane l block l of the step, two steps per
iteration: per lane and row one 16-byte nibble load a step (each warp load one 512-byte span), the high
bits, scales and sub-scales beside it in one sector or less per row. A block of 8 warps stages the
activations of up to 16 tokens in shared memory once per chunk of columns, transposed so that a lane's 8
words are conflict-free, together with xs and xs * sum(xq) per block (the sum by dp4a against ones, once per
block of the chunk, for the types with a minimum). Launches of more than 16 tokens take token tiles of 16
(grid y): a tile's blocks run beside the other tiles' on the same rows, so each weight byte comes from DRAM
about once and from L2 per tile (prompt chunks; a register-tiled GEMM like `gemm.py`'s would reuse it in
registers instead). Outputs may be a column range of a wider output (`out_first`): fused matrices whose
parts have different types run one launch a part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import cuda, float32, int32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    WARP_SIZE,
    allow_dependent_grids,
    dp4a,
    load_u32x4,
    shfl_xor_f32,
    wait_for_prior_grids,
)
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.gemv import (
    BLOCK_THREADS,
    MAX_TOKENS,
    MODE_ACCUMULATE,
    MODE_SWIGLU,
    ROWS_PER_WARP,
    TOKEN_BUCKETS,
    WARPS_PER_BLOCK,
    check_aligned,
    check_mode,
    fold,
    pair_rows,
    row_pairs,
    silu_f32,
    token_bucket,
)
from cmpchat.kernels.quantize import QUANT_BLOCK, check_quantized

NIBBLE_WORDS = 4  # words of nibbles per 32-value block
STEP_BLOCKS = WARP_SIZE  # blocks a warp reads per step: one per lane
UNROLL = 2  # steps per loop iteration
ITERATION_BLOCKS = UNROLL * STEP_BLOCKS
MAX_CHUNK_BLOCKS = 128  # activation blocks per token staged at once (4096 columns)
STAGE_BLOCKS_TARGET = 512  # staged blocks per chunk for many tokens (16 KB of quants)
ONES = 0x01010101  # dp4a against it sums the four bytes


@dataclass(frozen=True, slots=True)
class KQuantFormat:
    """How one type is laid out on the GPU and turned into S and M (module docstring)."""

    tensor_type: T
    group_values: int
    """Values per fp16 group (256 for the k-quants, 32 for the legacy types)."""
    high_bits: int
    """Bits of q above the low 4: 0, 1 or 2."""
    has_min: bool
    offset: int
    """Subtracted from q (types without a minimum)."""

    @property
    def sub_scales(self) -> bool:
        """Integer scales per sub-block (the k-quants)."""
        return self.group_values > QUANT_BLOCK

    @property
    def split_scale(self) -> bool:
        """A scale per 16 values (Q6_K)."""
        return self.sub_scales and not self.has_min

    @property
    def fields(self) -> int:
        """fp16 values per group: d, and dmin or m for the types with a minimum."""
        return 2 if self.has_min else 1

    def shapes(self, rows: int, cols: int) -> dict[str, tuple[int, int]]:
        """The GPU arrays' shapes for a [rows, cols] matrix (placeholders [1, 1])."""
        blocks = cols // QUANT_BLOCK
        return {
            "nibbles": (rows, blocks * NIBBLE_WORDS),
            "high": (rows, blocks * self.high_bits) if self.high_bits else (1, 1),
            "sub_scales": (rows, blocks) if self.sub_scales else (1, 1),
            "scales": (rows, cols // self.group_values * self.fields),
        }

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """GPU bytes of a [rows, cols] matrix as repacked."""
        itemsize = {"nibbles": 4, "high": 4, "sub_scales": 2, "scales": 2}
        shapes = self.shapes(rows, cols)
        return sum(itemsize[name] * shape[0] * shape[1] for name, shape in shapes.items() if shape[0] == rows)


FORMATS = {
    f.tensor_type: f
    for f in (
        KQuantFormat(T.Q4_0, 32, 0, False, 8),
        KQuantFormat(T.Q4_1, 32, 0, True, 0),
        KQuantFormat(T.Q5_0, 32, 1, False, 16),
        KQuantFormat(T.Q5_1, 32, 1, True, 0),
        KQuantFormat(T.Q4_K, 256, 0, True, 0),
        KQuantFormat(T.Q5_K, 256, 1, True, 0),
        KQuantFormat(T.Q6_K, 256, 2, False, 32),
    )
}
KQUANT_TYPES = tuple(FORMATS)


@dataclass(frozen=True, slots=True)
class KQuantArrays:
    """One repacked matrix's arrays (device arrays for launches, numpy arrays on the host)."""

    nibbles: Any
    high: Any
    sub_scales: Any
    scales: Any


ARRAY_DTYPES = {"nibbles": np.uint32, "high": np.uint32, "sub_scales": np.uint16, "scales": np.float16}

GEMV_KQUANT_SIGNATURE = (
    "void(uint32[::1], uint32[::1], uint16[::1], float16[::1], uint32[::1], float32[::1], float32[::1], "
    "int32, int32, int32, int32, int32, int32)"
)


def chunk_blocks(tokens: int) -> int:
    """Activation blocks per token staged at once (a multiple of ITERATION_BLOCKS and a power of two)."""
    return max(ITERATION_BLOCKS, min(MAX_CHUNK_BLOCKS, STAGE_BLOCKS_TARGET // tokens))


@cuda.jit(device=True, inline=True)
def signed_byte(value):
    return int32(value) - ((int32(value) & 0x80) << 1)


def block_reader(fmt: KQuantFormat) -> tuple[Any, Any, Any]:
    """Device functions for one type's blocks, shared by this GEMV and the GEMM (`gemm.py`):

    - read_block(nibbles, high, sub_scales, scales, row, block, blocks): a row's block (row and block in
      range): its 4 nibble words, 2 high words, S (S of the first 16 values for Q6_K), S of the second 16
      (Q6_K; else S) and M (0 for the types without a minimum);
    - block_words(n0, n1, n2, n3, h0, h1): the block's 32 values as 8 int8 words, q - offset (word c:
      values 4c..4c+3 for c < 4, 16 + 4(c - 4).. above);
    - block_term(q, s0, s1, m, x0..x7, xs, xm): the block's xs * (S dot(q, x) + M sum(x)) (xm = xs * sum(x))."""
    high_bits, has_min, split_scale, sub_scales_on = fmt.high_bits, fmt.has_min, fmt.split_scale, fmt.sub_scales
    offset_bias = (128 - fmt.offset) * ONES  # (q + bias) ^ 0x80808080 is q - offset in each signed byte
    with_offset = fmt.offset != 0
    group_log2 = (fmt.group_values // QUANT_BLOCK).bit_length() - 1
    fields = fmt.fields

    @cuda.jit(device=True, inline=True)
    def read_block(nibbles, high, sub_scales, scales, row, block, blocks):
        h0 = h1 = uint32(0)
        m = float32(0.0)
        b = uint64(row * blocks + block)
        n0, n1, n2, n3 = load_u32x4(nibbles, b * uint64(NIBBLE_WORDS))
        if high_bits == 1:
            h0 = high[b]
            h1 = h0
        elif high_bits == 2:
            h0 = high[b * uint64(2)]
            h1 = high[b * uint64(2) + uint64(1)]
        if sub_scales_on:
            group = uint64((row * (blocks >> group_log2) + (block >> group_log2)) * fields)
            d = float32(scales[group])
            packed = int32(sub_scales[b])
            if split_scale:
                s0 = d * float32(signed_byte(packed & 0xFF))
                s1 = d * float32(signed_byte(packed >> 8))
            else:
                s0 = s1 = d * float32(packed & 0xFF)
                m = -(float32(scales[group + uint64(1)]) * float32(packed >> 8))
        else:
            s0 = s1 = float32(scales[b * uint64(fields)])
            if has_min:
                m = float32(scales[b * uint64(fields) + uint64(1)])
        return n0, n1, n2, n3, h0, h1, s0, s1, m

    @cuda.jit(device=True, inline=True)
    def int8_words(nibble, h0, h1, c):
        """Values 4c..4c+3 and 16+4c..16+4c+3 of a block as signed int8 words, from its nibble word c."""
        low = nibble & 0x0F0F0F0F
        high = (nibble >> 4) & 0x0F0F0F0F
        if high_bits == 1:
            low |= ((h0 >> c) & ONES) << 4
            high |= ((h0 >> (c + 4)) & ONES) << 4
        elif high_bits == 2:
            low |= ((h0 >> (2 * c)) & 0x03030303) << 4
            high |= ((h1 >> (2 * c)) & 0x03030303) << 4
        if with_offset:
            low = (low + offset_bias) ^ 0x80808080
            high = (high + offset_bias) ^ 0x80808080
        return uint32(low), uint32(high)

    @cuda.jit(device=True, inline=True)
    def block_words(n0, n1, n2, n3, h0, h1):
        q0, q4 = int8_words(n0, h0, h1, 0)
        q1, q5 = int8_words(n1, h0, h1, 1)
        q2, q6 = int8_words(n2, h0, h1, 2)
        q3, q7 = int8_words(n3, h0, h1, 3)
        return q0, q1, q2, q3, q4, q5, q6, q7

    @cuda.jit(device=True, inline=True)
    def block_term(q, s0, s1, m, x0, x1, x2, x3, x4, x5, x6, x7, xs, xm):
        """xs * (S dot(q, x) + M sum(x)) for one row's block (q: its 8 int8 words; xm = xs * sum(x))."""
        low = dp4a(q[3], x3, dp4a(q[2], x2, dp4a(q[1], x1, dp4a(q[0], x0, 0))))
        high = dp4a(q[7], x7, dp4a(q[6], x6, dp4a(q[5], x5, dp4a(q[4], x4, 0))))
        if split_scale:
            return float32(low) * (s0 * xs) + float32(high) * (s1 * xs)
        term = float32(low + high) * (s0 * xs)
        if has_min:
            term += m * xm
        return term

    return read_block, block_words, block_term


def _make_gemv_kquant(fmt: KQuantFormat, tokens_max: int) -> Any:
    chunk = chunk_blocks(tokens_max)
    chunk_log2 = chunk.bit_length() - 1
    stage_blocks = tokens_max * chunk
    stage_words = stage_blocks * 8
    rounds = -(-stage_blocks // BLOCK_THREADS)
    has_min = fmt.has_min
    min_stage = stage_blocks if has_min else 1
    sums = ROWS_PER_WARP * tokens_max
    spread = 5 - (sums.bit_length() - 1)
    live_16, live_8, live_4, live_2, live_1 = (max(sums >> level, 1) for level in range(5))
    read_block, unpack_words, block_term = block_reader(fmt)

    @cuda.jit(device=True, inline=True)
    def load_block(nibbles, high, sub_scales, scales, row, block, blocks):
        """`read_block`, or zeros past the row's end."""
        n0 = n1 = n2 = n3 = h0 = h1 = uint32(0)
        s0 = s1 = m = float32(0.0)
        if block < blocks:
            n0, n1, n2, n3, h0, h1, s0, s1, m = read_block(nibbles, high, sub_scales, scales, row, block, blocks)
        return n0, n1, n2, n3, h0, h1, s0, s1, m

    @cuda.jit(device=True, inline=True)
    def block_words(loaded):
        return unpack_words(loaded[0], loaded[1], loaded[2], loaded[3], loaded[4], loaded[5])

    @cuda.jit(device=True, inline=True)
    def accumulate(acc, t, local, qa, la, qb, lb, stage_q, stage_s, stage_m):
        """Rows a and b's terms of staged block `local` of token t (qa, qb: their int8 words; la, lb: what
        `load_block` gave) into acc[2t], acc[2t + 1]."""
        src = uint64(t * chunk * 8 + ((local >> 5) << 8) + (local & 31))
        x0, x1, x2, x3 = stage_q[src], stage_q[src + uint64(32)], stage_q[src + uint64(64)], stage_q[src + uint64(96)]
        x4, x5, x6 = stage_q[src + uint64(128)], stage_q[src + uint64(160)], stage_q[src + uint64(192)]
        x7 = stage_q[src + uint64(224)]
        g = uint64(t * chunk + local)
        scale = stage_s[g]
        summed = stage_m[g] if has_min else float32(0.0)
        acc[2 * t] += block_term(qa, la[6], la[7], la[8], x0, x1, x2, x3, x4, x5, x6, x7, scale, summed)
        acc[2 * t + 1] += block_term(qb, lb[6], lb[7], lb[8], x0, x1, x2, x3, x4, x5, x6, x7, scale, summed)

    def gemv_kquant(nibbles, high, sub_scales, scales, xq, xs, y, rows, blocks, tokens, mode, out_stride, out_first):
        wait_for_prior_grids()
        allow_dependent_grids()
        tid = cuda.threadIdx.x
        lane = tid & (WARP_SIZE - 1)
        pair = cuda.blockIdx.x * WARPS_PER_BLOCK + (tid >> 5)
        token0 = cuda.blockIdx.y * tokens_max
        tokens_here = min(tokens - token0, tokens_max)
        row_a, row_b, out_rows = pair_rows(pair, rows, mode)
        live_a = row_a < out_rows if mode == MODE_SWIGLU else row_a < rows
        # Dead rows read a live row (clamped) instead of branching: every warp reaches the barriers.
        read_a = min(row_a, rows - 1)
        read_b = min(row_b, rows - 1)
        words = blocks * 8

        acc = cuda.local.array(sums, float32)  # acc[2t] row a, acc[2t + 1] row b, token t
        for i in range(sums):
            acc[i] = float32(0.0)
        stage_q = cuda.shared.array(stage_words, uint32)
        stage_s = cuda.shared.array(stage_blocks, float32)
        stage_m = cuda.shared.array(min_stage, float32)

        for start in range(0, blocks, chunk):
            cuda.syncthreads()  # the previous chunk's readers are done
            for i in range(rounds):
                g = i * BLOCK_THREADS + tid
                if g < stage_blocks:
                    t = g >> chunk_log2
                    local = g & (chunk - 1)
                    block = start + local
                    v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = uint32(0)
                    scale = float32(0.0)
                    if t < tokens_here and block < blocks:
                        src = uint64((token0 + t) * words + block * 8)
                        v0, v1, v2, v3 = load_u32x4(xq, src)
                        v4, v5, v6, v7 = load_u32x4(xq, src + uint64(4))
                        scale = xs[uint64((token0 + t) * blocks + block)]
                    # Word c of the block at 32c + (its lane in the step): a lane's 8 reads hit 8 distinct banks.
                    dst = uint64(t * chunk * 8 + ((local >> 5) << 8) + (local & 31))
                    stage_q[dst] = v0
                    stage_q[dst + uint64(32)] = v1
                    stage_q[dst + uint64(64)] = v2
                    stage_q[dst + uint64(96)] = v3
                    stage_q[dst + uint64(128)] = v4
                    stage_q[dst + uint64(160)] = v5
                    stage_q[dst + uint64(192)] = v6
                    stage_q[dst + uint64(224)] = v7
                    stage_s[uint64(g)] = scale
                    if has_min:
                        total = dp4a(v3, ONES, dp4a(v2, ONES, dp4a(v1, ONES, dp4a(v0, ONES, 0))))
                        total = dp4a(v7, ONES, dp4a(v6, ONES, dp4a(v5, ONES, dp4a(v4, ONES, total))))
                        stage_m[uint64(g)] = scale * float32(total)
            cuda.syncthreads()

            for step in range(0, min(chunk, blocks - start), ITERATION_BLOCKS):
                block0 = start + step + lane
                # Every load of the iteration first (2 rows x 2 steps), then the arithmetic.
                a0 = load_block(nibbles, high, sub_scales, scales, read_a, block0, blocks)
                b0 = load_block(nibbles, high, sub_scales, scales, read_b, block0, blocks)
                a1 = load_block(nibbles, high, sub_scales, scales, read_a, block0 + STEP_BLOCKS, blocks)
                b1 = load_block(nibbles, high, sub_scales, scales, read_b, block0 + STEP_BLOCKS, blocks)
                qa0, qb0, qa1, qb1 = block_words(a0), block_words(b0), block_words(a1), block_words(b1)
                for t in range(tokens_max):
                    first = step + lane
                    accumulate(acc, t, first, qa0, a0, qb0, b0, stage_q, stage_s, stage_m)
                    accumulate(acc, t, first + STEP_BLOCKS, qa1, a1, qb1, b1, stage_q, stage_s, stage_m)

        # The Q8_0 GEMV's reduce-scatter: afterwards lane l holds sum number l >> spread.
        fold(acc, lane, 16, live_16)
        fold(acc, lane, 8, live_8)
        fold(acc, lane, 4, live_4)
        fold(acc, lane, 2, live_2)
        fold(acc, lane, 1, live_1)
        total = acc[0]
        partner = shfl_xor_f32(total, 1 << spread)  # the other row of the pair, same token (SwiGLU)
        index = lane >> spread
        t = index >> 1
        if (lane & ((1 << spread) - 1)) == 0 and t < tokens_here:
            out = (token0 + t) * out_stride + out_first
            if mode == MODE_SWIGLU:
                if (index & 1) == 0 and live_a:
                    y[uint64(out + row_a)] = silu_f32(total) * partner
            else:
                row = row_a if (index & 1) == 0 else row_b
                if row_a < rows and row < rows:
                    if mode == MODE_ACCUMULATE:
                        y[uint64(out + row)] += total
                    else:
                        y[uint64(out + row)] = total

    name = f"gemv_{fmt.tensor_type.name.lower()}_t{tokens_max}"
    gemv_kquant.__name__ = gemv_kquant.__qualname__ = name
    return kernel(GEMV_KQUANT_SIGNATURE, early_launch=True)(gemv_kquant)


GEMV_KQUANT = {(t, tokens): _make_gemv_kquant(fmt, tokens) for t, fmt in FORMATS.items() for tokens in TOKEN_BUCKETS}


# ---------------------------------------------------------------------------------------------- host side


def check_kquant_arrays(tensor_type: T, arrays: KQuantArrays, rows: int, cols: int) -> KQuantFormat:
    if tensor_type not in FORMATS:
        raise ValueError(f"no 4/5/6-bit GEMV for {tensor_type.name}")
    fmt = FORMATS[tensor_type]
    if rows < 1 or cols < 1 or cols % fmt.group_values:
        raise ValueError(f"{tensor_type.name} rows hold whole blocks of {fmt.group_values}, got {(rows, cols)}")
    for name, shape in fmt.shapes(rows, cols).items():
        check_array(getattr(arrays, name), f"weight {name}", ARRAY_DTYPES[name], 2, shape)
    check_aligned(arrays.nibbles, "weight nibbles")
    return fmt


def check_kquant_matmul(
    tensor_type: T, arrays: KQuantArrays, cols: int, x_quants: Any, x_scales: Any, out: Any, mode: str, out_first: int
) -> tuple[int, int, int, int]:
    """(rows, tokens, mode code, out's row stride) of a valid 4/5/6-bit matmul (this GEMV's or the GEMM's)."""
    rows = int(arrays.nibbles.shape[0])
    check_kquant_arrays(tensor_type, arrays, rows, cols)
    tokens = int(x_quants.shape[0]) if len(x_quants.shape) == 2 else 0
    if tokens < 1:
        raise ValueError("no tokens to multiply")
    check_quantized(x_quants, x_scales, tokens, cols)
    check_aligned(x_quants, "activation quants")
    code = check_mode(mode, rows)
    _, out_stride = check_array(out, "out", np.float32, 2)
    written = rows // 2 if mode == "swiglu" else rows
    if int(out.shape[0]) != tokens or not 0 <= out_first <= out_stride - written:
        raise ValueError(
            f"out {tuple(out.shape)} has no columns {out_first}..{out_first + written} for {tokens} tokens"
        )
    return rows, tokens, code, out_stride


def kquant_matmul_launch(
    tensor_type: T,
    arrays: KQuantArrays,
    cols: int,
    x_quants: Any,
    x_scales: Any,
    out: Any,
    *,
    mode: str = "store",
    out_first: int = 0,
) -> Launch:
    """y = W x for any number of quantised tokens (layouts in the module docstring): 16 at most in one token
    tile, more in tiles of 16.

    mode "store" writes out[:, out_first : out_first + rows]; "accumulate" adds into it; "swiglu" takes
    W = [gate | up] stacked along rows and writes silu(gate x) * (up x) into out [T, rows/2].
    """
    rows, tokens, code, out_stride = check_kquant_matmul(tensor_type, arrays, cols, x_quants, x_scales, out, mode,
                                                         out_first)  # fmt: skip
    bucket = token_bucket(min(tokens, MAX_TOKENS))
    grid = (-(-row_pairs(rows, mode) // WARPS_PER_BLOCK), -(-tokens // bucket))
    args = (
        arrays.nibbles.reshape(-1), arrays.high.reshape(-1), arrays.sub_scales.reshape(-1), arrays.scales.reshape(-1),
        x_quants.reshape(-1), x_scales.reshape(-1), out.reshape(-1), np.int32(rows), np.int32(cols // QUANT_BLOCK),
        np.int32(tokens), np.int32(code), np.int32(out_stride), np.int32(out_first),
    )  # fmt: skip
    return Launch(GEMV_KQUANT[(tensor_type, bucket)], grid, BLOCK_THREADS, args)
