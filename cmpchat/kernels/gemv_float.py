"""Fallback matrix-vector products for F32, F16 and BF16 weights x fp32 activations, 1..16 tokens.

Third-party GGUF files may keep some 2-D tensors unquantised; these kernels give them the same output
contract as `gemv.py` (fp32 [T, rows]; modes store / accumulate / swiglu) so the backend treats every
projection alike. Results equal `x @ W.T` in fp32 up to summation order (the tests allow 1e-5 of the sum
of |terms|).

Layouts: weights [rows, cols] C-contiguous and 16-byte aligned, passed as uint32 words (F32: one value a
word; F16 and BF16: two values a word, the lower-indexed one in the low half; numpy has no bfloat16, so a
BF16 tensor is its uint16 bits); cols a multiple of 8. Activations fp32 [T, cols]; output as in gemv.py.

Tiling mirrors gemv.py: a warp owns two rows and reads 512 bytes of each per step (16 bytes a lane, one
`load_u32x4`), so the weights stream at full width; the block stages each chunk of activations (fp32, all
tokens) in shared memory once for its 16 rows, transposed within a step so that a lane's 4 (F32) or 8
(16-bit) consecutive activations are conflict-free 32-bit shared loads. Decoding a 16-bit weight costs one
conversion (F16) or one shift (BF16); these kernels are a fallback and are not tuned further.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import WARP_SIZE, load_u32x4, shfl_xor_f32
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.gemv import (
    BLOCK_THREADS,
    MODE_ACCUMULATE,
    MODE_SWIGLU,
    ROWS_PER_WARP,
    TOKEN_BUCKETS,
    WARPS_PER_BLOCK,
    check_aligned,
    check_mode,
    fold,
    output_shape,
    pair_rows,
    row_pairs,
    silu_f32,
    token_bucket,
)

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
WEIGHT_KINDS = {"f32": KIND_F32, "f16": KIND_F16, "bf16": KIND_BF16}
_KIND_OF_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}

STAGE_VALUES_TARGET = 4096  # staged fp32 activations per block (16 KB)
MAX_CHUNK_VALUES = 1024  # per token; more would only raise the T=1 kernel's registers (staging is unrolled)

GEMV_FLOAT_SIGNATURE = "void(uint32[::1], float32[::1], float32[::1], int32, int32, int32, int32)"


@cuda.jit(device=True, inline=True)
def _bits_to_f32(word):
    scratch = cuda.local.array(1, uint32)  # a bit cast: LLVM turns the round trip into a register move
    scratch[0] = word
    return scratch.view(np.float32)[0]


@cuda.jit(device=True, inline=True)
def _decode(word, kind):
    """The two weights of a 16-bit word (low half first), or (value, 0) for F32."""
    if kind == KIND_F32:
        return _bits_to_f32(word), float32(0.0)
    if kind == KIND_BF16:
        return _bits_to_f32(word << 16), _bits_to_f32(word & uint32(0xFFFF0000))
    scratch = cuda.local.array(1, uint32)
    scratch[0] = word
    halves = scratch.view(np.float16)
    return float32(halves[0]), float32(halves[1])


def _make_gemv_float(kind: int, tokens_max: int) -> Any:
    per_word = 1 if kind == KIND_F32 else 2  # weights per 32-bit word
    lane_values = 4 * per_word  # activations a lane needs per step (16 bytes of weights)
    step_values = WARP_SIZE * lane_values  # columns per 512-byte step
    chunk = max(step_values, min(MAX_CHUNK_VALUES, STAGE_VALUES_TARGET // tokens_max))
    stage_values = tokens_max * chunk
    stage_rounds = stage_values // BLOCK_THREADS
    sums = ROWS_PER_WARP * tokens_max
    spread = 5 - (sums.bit_length() - 1)
    live_16, live_8, live_4, live_2, live_1 = (max(sums >> level, 1) for level in range(5))

    def gemv_float(wq, x, y, rows, cols, tokens, mode):
        tid = cuda.threadIdx.x
        lane = tid & (WARP_SIZE - 1)
        pair = cuda.blockIdx.x * WARPS_PER_BLOCK + (tid >> 5)
        row_a, row_b, out_rows = pair_rows(pair, rows, mode)
        words = cols // per_word
        base_a = min(row_a, rows - 1) * words
        base_b = min(row_b, rows - 1) * words

        acc = cuda.local.array(sums, float32)
        for i in range(sums):
            acc[i] = float32(0.0)
        stage = cuda.shared.array(stage_values, float32)

        for start in range(0, cols, chunk):
            cuda.syncthreads()
            for i in range(stage_rounds):
                v = i * BLOCK_THREADS + tid
                t = v // chunk
                col = v - t * chunk  # column within the chunk
                value = float32(0.0)
                if t < tokens and start + col < cols:
                    value = x[uint64(t * cols + start + col)]
                # Transposed within each step: value lane_values*l + c of the step goes to 32c + l.
                within = col % step_values
                stage[uint64(t * chunk + col - within + (within % lane_values) * WARP_SIZE + within // lane_values)] = (
                    value
                )
            cuda.syncthreads()

            for step in range(0, min(chunk, cols - start), step_values):
                first = start + step + lane_values * lane  # this lane's first column
                w0 = w1 = w2 = w3 = wb0 = wb1 = wb2 = wb3 = uint32(0)
                if first < cols:
                    offset = first // per_word
                    w0, w1, w2, w3 = load_u32x4(wq, uint64(base_a + offset))
                    wb0, wb1, wb2, wb3 = load_u32x4(wq, uint64(base_b + offset))
                for t in range(tokens_max):
                    q = t * chunk + step + lane
                    da = db = float32(0.0)
                    for j in range(4):
                        word_a = w0 if j == 0 else (w1 if j == 1 else (w2 if j == 2 else w3))
                        word_b = wb0 if j == 0 else (wb1 if j == 1 else (wb2 if j == 2 else wb3))
                        a_lo, a_hi = _decode(word_a, kind)
                        b_lo, b_hi = _decode(word_b, kind)
                        x_lo = stage[uint64(q + (per_word * j) * WARP_SIZE)]
                        da += a_lo * x_lo
                        db += b_lo * x_lo
                        if per_word == 2:
                            x_hi = stage[uint64(q + (2 * j + 1) * WARP_SIZE)]
                            da += a_hi * x_hi
                            db += b_hi * x_hi
                    acc[2 * t] += da
                    acc[2 * t + 1] += db

        fold(acc, lane, 16, live_16)
        fold(acc, lane, 8, live_8)
        fold(acc, lane, 4, live_4)
        fold(acc, lane, 2, live_2)
        fold(acc, lane, 1, live_1)
        total = acc[0]
        partner = shfl_xor_f32(total, 1 << spread)
        index = lane >> spread
        t = index >> 1
        if (lane & ((1 << spread) - 1)) == 0 and t < tokens:
            out = t * out_rows
            if mode == MODE_SWIGLU:
                if (index & 1) == 0 and row_a < out_rows:
                    y[uint64(out + row_a)] = silu_f32(total) * partner
            else:
                row = row_a if (index & 1) == 0 else row_b
                if row < rows:
                    if mode == MODE_ACCUMULATE:
                        y[uint64(out + row)] += total
                    else:
                        y[uint64(out + row)] = total

    name = f"gemv_{[k for k, v in WEIGHT_KINDS.items() if v == kind][0]}_t{tokens_max}"
    gemv_float.__name__ = gemv_float.__qualname__ = name
    return kernel(GEMV_FLOAT_SIGNATURE)(gemv_float)


GEMV_FLOAT = {
    (kind, tokens): _make_gemv_float(kind, tokens) for kind in WEIGHT_KINDS.values() for tokens in TOKEN_BUCKETS
}


def gemv_float_launch(weight: Any, x: Any, out: Any, *, mode: str = "store", bf16: bool = False) -> Launch:
    """y = W x for an unquantised weight [rows, cols]: float32, float16, or uint16 holding BF16 (bf16=True).

    x fp32 [T <= 16, cols]; out fp32 [T, rows] ([T, rows/2] for "swiglu"); modes as `gemv_q8_launch`.
    """
    dtype = np.dtype(weight.dtype)
    kind_name = _KIND_OF_DTYPE.get(dtype)
    if kind_name is None or (kind_name == "bf16") != bf16:
        raise ValueError(f"weight must be float32, float16, or uint16 bits with bf16=True; got {dtype} (bf16={bf16})")
    rows, cols = check_array(weight, "weight", dtype, 2)
    if rows == 0 or cols == 0 or cols % 8:
        raise ValueError(f"weight columns must be a positive multiple of 8 (16-byte rows), got {(rows, cols)}")
    tokens = int(x.shape[0]) if len(x.shape) == 2 else 0
    check_array(x, "x", np.float32, 2, (tokens, cols))
    bucket = token_bucket(tokens)
    code = check_mode(mode, rows)
    check_array(out, "out", np.float32, 2, output_shape(rows, tokens, mode))
    check_aligned(weight, "weight")
    grid = (row_pairs(rows, mode) + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    words = weight.reshape(-1).view(np.uint32)
    args = (words, x.reshape(-1), out.reshape(-1), np.int32(rows), np.int32(cols), np.int32(tokens), np.int32(code))
    return Launch(GEMV_FLOAT[(WEIGHT_KINDS[kind_name], bucket)], grid, BLOCK_THREADS, args)
