"""int8 activation quantisation for the Q8_0 matmuls, alone or fused with the RMSNorm before them.

Layouts (what `gemv.py` reads): activations fp32 [T, n] with n a multiple of 32 become
- quants: uint32 words [T, n/4], four int8 packed little-endian (value 4w+j in byte j of word w);
- scales: fp32 [T, n/32], one per block of 32 values.

Numerics are those of `cmpchat.model.quant.quantize_activations`, bit for bit: scale = amax / 127 in fp32
(correctly rounded division), q = round-half-even(x / scale) with the division correctly rounded too, and an
all-zero block gets scale 0 and quants 0. Both divisions come from a product and two FMAs (`divide_exactly`,
the same bits) except in blocks of tiny values, where `/` (Numba: `div.rn.f32`, no fast-math) does them; and
round-half-even is done with the 1.5 * 2^23 trick in fp32 (Numba's `round` goes through fp64, which the CMP
may run slowly); |x / scale| <= 127.5 is far inside the trick's range.

The fused RMSNorm follows `rms_norm` exactly (x * (1 / sqrt(mean(x^2) + eps)) * w, fp32, in that order);
only the sum of squares is added in another order than numpy's pairwise sum, so the normalisation factor can
differ by an ulp or so. The normalised values then agree to ~2 ulp, and a quant differs (by 1) only where
x / scale sits within that distance of a .5 boundary: in practice a handful per million values. The fp32
output, when asked for, is exactly what was quantised.

Tiling: one thread per output word (4 consecutive values), so 8 neighbouring lanes hold one 32-value block
and its amax is a 3-step butterfly (xor 1, 2, 4). Quantisation is one block-row per (thread block, token);
RMSNorm needs the whole row's sum of squares first, so it runs one thread block per token and reads the row
twice (the second read hits L1/L2: rows are at most 20 KB).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32, uint32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import (
    MAX_BLOCK_THREADS,
    WARP_SIZE,
    allow_dependent_grids,
    block_sum_f32,
    fma_f32,
    shfl_xor_f32,
    wait_for_prior_grids,
)
from cmpchat.cudart.launch import Launch, check_array

QUANT_BLOCK = 32
VALUES_PER_WORD = 4
DEFAULT_THREADS = 256

_ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 to an integer, ties to even
_RECIPROCAL_127 = float(np.float32(1.0) / np.float32(127.0))  # 1/127 correctly rounded to fp32
_EXACT_FROM = 2.0**-90
"""Blocks whose amax is at least this get their divisions from `divide_exactly`: the scale is then at least
2^-97, so every value whose quant is not 0 is at least 2^-99, and every remainder stays normal."""


@cuda.jit(device=True, inline=True)
def round_half_even_f32(x):
    """rint(x) for |x| < 2^22, in fp32 round-to-nearest-even (the integer stays a float32)."""
    magic = float32(_ROUNDING_MAGIC)
    return (x + magic) - magic


@cuda.jit(device=True, inline=True)
def divide_exactly(x, divisor, reciprocal):
    """x / divisor correctly rounded, given reciprocal = 1 / divisor correctly rounded: Markstein's
    correction of the product, whose remainder x - q * divisor an FMA gets exactly. Holds while that
    remainder is not subnormal: |x| >= 2^-100 or so, or x so small against the divisor that its quotient
    rounds to the integer 0 either way. Three instructions where `/` costs about 16 and a slow-path branch."""
    quotient = x * reciprocal
    remainder = fma_f32(-quotient, divisor, x)
    return fma_f32(remainder, reciprocal, quotient)


@cuda.jit(device=True, inline=True)
def quantize_word(x0, x1, x2, x3, amax):
    """Pack round(x_j / (amax / 127)) into one word (little-endian int8s) and return (word, scale)."""
    # One division per word, for the reciprocal: the fused GEMV's prologue is issue-bound, and this made the
    # fused GEMVs of a 27B step 8.08 -> 8.03 ms and of a 9B step 2.64 -> 2.62 ms, same bits (H200, 2026-12-01).
    if amax >= float32(_EXACT_FROM):
        scale = divide_exactly(amax, float32(127.0), float32(_RECIPROCAL_127))
        reciprocal = float32(1.0) / scale
        q0 = divide_exactly(x0, scale, reciprocal)
        q1 = divide_exactly(x1, scale, reciprocal)
        q2 = divide_exactly(x2, scale, reciprocal)
        q3 = divide_exactly(x3, scale, reciprocal)
    else:  # all zero (scale 0, quants 0) or tiny: plain divisions
        scale = amax / float32(127.0)
        safe = scale if scale != float32(0.0) else float32(1.0)
        q0, q1, q2, q3 = x0 / safe, x1 / safe, x2 / safe, x3 / safe
    q0 = int32(round_half_even_f32(q0))
    q1 = int32(round_half_even_f32(q1))
    q2 = int32(round_half_even_f32(q2))
    q3 = int32(round_half_even_f32(q3))
    word = uint32(q0 & 0xFF) | (uint32(q1 & 0xFF) << 8) | (uint32(q2 & 0xFF) << 16) | (uint32(q3 & 0xFF) << 24)
    return word, scale


@cuda.jit(device=True, inline=True)
def block_amax(x0, x1, x2, x3):
    """Max |x| over the 32 values held by 8 neighbouring lanes (all lanes of the block must call this)."""
    amax = max(max(abs(x0), abs(x1)), max(abs(x2), abs(x3)))
    amax = max(amax, shfl_xor_f32(amax, 1))
    amax = max(amax, shfl_xor_f32(amax, 2))
    amax = max(amax, shfl_xor_f32(amax, 4))
    return amax


@kernel("void(float32[:, ::1], uint32[:, ::1], float32[:, ::1])", early_launch=True)
def quantize_rows(x, quants, scales):
    wait_for_prior_grids()
    allow_dependent_grids()
    token = cuda.blockIdx.y
    word = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    live = word < quants.shape[1]
    x0 = x1 = x2 = x3 = float32(0.0)
    if live:
        base = VALUES_PER_WORD * word
        x0, x1, x2, x3 = x[token, base], x[token, base + 1], x[token, base + 2], x[token, base + 3]
    amax = block_amax(x0, x1, x2, x3)  # every thread takes part (the simulator's shuffle is a block barrier)
    packed, scale = quantize_word(x0, x1, x2, x3, amax)
    if live:
        quants[token, word] = packed
        if word % 8 == 0:
            scales[token, word // 8] = scale


def _make_rms_norm_quantize(keep_normalized: bool) -> Any:
    def rms_norm_quantize(x, weight, eps, quants, scales, normalized):
        wait_for_prior_grids()
        allow_dependent_grids()
        token, tid, threads = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        words = quants.shape[1]
        rounds = (words + threads - 1) // threads  # the same for every thread: shuffles stay uniform
        sum_squares = float32(0.0)
        for r in range(rounds):
            word = r * threads + tid
            if word < words:
                for j in range(VALUES_PER_WORD):
                    v = x[token, VALUES_PER_WORD * word + j]
                    sum_squares += v * v
        mean_square = block_sum_f32(sum_squares) / float32(x.shape[1])
        factor = float32(1.0) / math.sqrt(mean_square + eps)
        for r in range(rounds):
            word = r * threads + tid
            live = word < words
            y0 = y1 = y2 = y3 = float32(0.0)
            if live:
                base = VALUES_PER_WORD * word
                y0 = x[token, base] * factor * weight[base]
                y1 = x[token, base + 1] * factor * weight[base + 1]
                y2 = x[token, base + 2] * factor * weight[base + 2]
                y3 = x[token, base + 3] * factor * weight[base + 3]
            amax = block_amax(y0, y1, y2, y3)
            packed, scale = quantize_word(y0, y1, y2, y3, amax)
            if live:
                quants[token, word] = packed
                if word % 8 == 0:
                    scales[token, word // 8] = scale
                if keep_normalized:
                    base = VALUES_PER_WORD * word
                    normalized[token, base] = y0
                    normalized[token, base + 1] = y1
                    normalized[token, base + 2] = y2
                    normalized[token, base + 3] = y3

    name = "rms_norm_quantize_keep" if keep_normalized else "rms_norm_quantize"
    rms_norm_quantize.__name__ = rms_norm_quantize.__qualname__ = name
    # Without the fp32 output the kernel still takes an array there (never touched): one calling convention.
    signature = "void(float32[:, ::1], float32[::1], float32, uint32[:, ::1], float32[:, ::1], float32[:, ::1])"
    return kernel(signature, early_launch=True)(rms_norm_quantize)


rms_norm_quantize = _make_rms_norm_quantize(False)
rms_norm_quantize_keep = _make_rms_norm_quantize(True)


# ---------------------------------------------------------------------------------------------- launchers


def check_quantized(quants: Any, scales: Any, tokens: int, n: int, what: str = "activation") -> None:
    """quants uint32 [tokens, n/4] and scales fp32 [tokens, n/32]."""
    check_array(quants, f"{what} quants", np.uint32, 2, (tokens, n // VALUES_PER_WORD))
    check_array(scales, f"{what} scales", np.float32, 2, (tokens, n // QUANT_BLOCK))


def _check_threads(threads: int) -> None:
    if threads % WARP_SIZE or not 0 < threads <= MAX_BLOCK_THREADS:
        raise ValueError(f"threads must be a multiple of {WARP_SIZE} up to {MAX_BLOCK_THREADS}, got {threads}")


def _row_width(x: Any) -> tuple[int, int]:
    tokens, n = check_array(x, "x", np.float32, 2)
    if n % QUANT_BLOCK or n == 0 or tokens == 0:
        raise ValueError(f"rows must be non-empty multiples of {QUANT_BLOCK} values, got x of shape {(tokens, n)}")
    return tokens, n


def quantize_launch(x: Any, quants: Any, scales: Any, *, threads: int = DEFAULT_THREADS) -> Launch:
    """Quantise fp32 rows x [T, n] into quants uint32 [T, n/4] and scales fp32 [T, n/32]."""
    _check_threads(threads)
    tokens, n = _row_width(x)
    check_quantized(quants, scales, tokens, n)
    words = n // VALUES_PER_WORD
    return Launch(quantize_rows, ((words + threads - 1) // threads, tokens), threads, (x, quants, scales))


def rms_norm_quantize_launch(
    x: Any,
    weight: Any,
    eps: float,
    quants: Any,
    scales: Any,
    normalized: Any | None = None,
    *,
    threads: int = DEFAULT_THREADS,
) -> Launch:
    """RMSNorm rows x [T, n] with weight fp32 [n] and quantise the result (layouts as `quantize_launch`).

    Give `normalized` (fp32 [T, n], may not alias x) to also keep the fp32 normalised rows.
    """
    _check_threads(threads)
    tokens, n = _row_width(x)
    check_array(weight, "weight", np.float32, 1, (n,))
    check_quantized(quants, scales, tokens, n)
    if normalized is None:
        dispatcher, normalized = rms_norm_quantize, x  # never written by this variant
    else:
        dispatcher = rms_norm_quantize_keep
        check_array(normalized, "normalized", np.float32, 2, (tokens, n))
    return Launch(dispatcher, tokens, threads, (x, weight, np.float32(eps), quants, scales, normalized))
