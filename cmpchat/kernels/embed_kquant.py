"""Token ids -> fp32 hidden rows from a 4/5/6-bit embedding (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

Files quantised to these types often store `token_embd.weight` in one of them: this gather lets the CUDA
backend read it in the layout its 4/5/6-bit matrices already have (`gemv_kquant.py`, `KQuantArrays`). Values are
the reader's (`model/dequant.py`) bit for bit: S and M of each 32 values are computed as the GEMV and the reader
compute them (exact fp32 products of an fp16 and a small integer), then w = S * q + M (types with a minimum) or
S * (q - offset), one rounding at most, in dequant.py's order. The semantics are `embed_q8_0`'s: ids in device
memory (a captured graph serves any tokens), a row of id `PLACED_ROW` keeps what it holds (an image row), any
other id outside the matrix gives a zero row. One thread per 4 values: the embedding is a tiny part of a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import cuda, float32, int32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import allow_dependent_grids, wait_for_prior_grids
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.elementwise import PLACED_ROW
from cmpchat.kernels.gemv_kquant import (
    FORMATS,
    NIBBLE_WORDS,
    ONES,
    KQuantArrays,
    KQuantFormat,
    check_kquant_arrays,
    signed_byte,
)
from cmpchat.kernels.quantize import QUANT_BLOCK

THREADS = 128
VALUE_WORDS = QUANT_BLOCK // 4  # words of 4 values per 32-value block, one thread each

EMBED_KQUANT_SIGNATURE = (
    "void(int32[::1], uint32[:, ::1], uint32[:, ::1], uint16[:, ::1], float16[:, ::1], float32[:, ::1])"
)


def _make_embed_kquant(fmt: KQuantFormat) -> Any:
    high_bits, has_min, sub_scales_on, split_scale = fmt.high_bits, fmt.has_min, fmt.sub_scales, fmt.split_scale
    offset, fields = fmt.offset, fmt.fields
    group_log2 = (fmt.group_values // QUANT_BLOCK).bit_length() - 1
    zero = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def quant_word(nibbles, high, row, block, w):
        """Values 4w..4w+3 of a row's 32-block as bytes: their whole q, before any offset."""
        q = (nibbles[row, block * NIBBLE_WORDS + (w & 3)] >> (4 * (w >> 2))) & 0x0F0F0F0F
        if high_bits == 1:
            q |= ((high[row, block] >> w) & ONES) << 4
        elif high_bits == 2:
            q |= ((high[row, 2 * block + (w >> 2)] >> (2 * (w & 3))) & 0x03030303) << 4
        return q

    @cuda.jit(device=True, inline=True)
    def block_scale(sub_scales, scales, row, block, half):
        """S and M of a row's 32-block (Q6_K: S of its 16-value half `half`), as the reader computes them."""
        s = m = zero
        if sub_scales_on:
            group = (block >> group_log2) * fields
            d = float32(scales[row, group])
            packed = int32(sub_scales[row, block])
            if split_scale:
                s = d * float32(signed_byte((packed >> (8 * half)) & 0xFF))
            else:
                s = d * float32(packed & 0xFF)
                m = -(float32(scales[row, group + 1]) * float32(packed >> 8))
        else:
            s = float32(scales[row, block * fields])
            if has_min:
                m = float32(scales[row, block * fields + 1])
        return s, m

    def embed_kquant_kernel(token_ids, nibbles, high, sub_scales, scales, hidden):
        """Block (word group, token); thread = one word of 4 values of the token's row."""
        wait_for_prior_grids()
        allow_dependent_grids()
        word = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        out = cuda.blockIdx.y
        if word >= hidden.shape[1] // 4:
            return
        token = token_ids[out]
        if token == PLACED_ROW:
            return
        column = 4 * word
        if token < 0 or token >= nibbles.shape[0]:  # idle row (or a bad id): zeros, never a wild read
            for i in range(4):
                hidden[out, column + i] = zero
            return
        block = word // VALUE_WORDS
        w = word % VALUE_WORDS
        q = quant_word(nibbles, high, token, block, w)
        s, m = block_scale(sub_scales, scales, token, block, w >> 2)
        for i in range(4):
            level = int32((q >> (8 * i)) & 0xFF)
            if has_min:
                hidden[out, column + i] = s * float32(level) + m
            else:
                hidden[out, column + i] = s * float32(level - offset)

    name = f"embed_{fmt.tensor_type.name.lower()}"
    embed_kquant_kernel.__name__ = embed_kquant_kernel.__qualname__ = name
    return kernel(EMBED_KQUANT_SIGNATURE, early_launch=True)(embed_kquant_kernel)


EMBED_KQUANT = {t: _make_embed_kquant(fmt) for t, fmt in FORMATS.items()}


def embed_kquant(tensor_type: T, token_ids: Any, arrays: KQuantArrays, hidden: Any) -> Launch:
    """hidden[b] = the exact fp32 row token_ids[b] of a repacked 4/5/6-bit matrix (`gemv_kquant.py`'s layout);
    a row of id `PLACED_ROW` keeps what it holds, any other id outside [0, rows) gives a zero row.

    token_ids [B] int32; arrays of a [rows, cols] matrix; hidden [B, cols] fp32. All C-contiguous.
    """
    if tensor_type not in FORMATS:
        raise ValueError(f"no 4/5/6-bit embedding for {tensor_type.name}")
    (batch,) = check_array(token_ids, "token_ids", np.int32, 1)
    if batch < 1:
        raise ValueError("no token ids to embed")
    rows, words = check_array(arrays.nibbles, "weight nibbles", np.uint32, 2)
    cols = words * (QUANT_BLOCK // NIBBLE_WORDS)
    check_array(hidden, "hidden", np.float32, 2)
    if tuple(hidden.shape) != (batch, cols):
        raise ValueError(
            f"hidden must have shape {(batch, cols)} (a row per token id, the matrix's width), got {tuple(hidden.shape)}"
        )
    check_kquant_arrays(tensor_type, arrays, rows, cols)
    grid = (-(-(cols // 4) // THREADS), batch)
    args = (token_ids, arrays.nibbles, arrays.high, arrays.sub_scales, arrays.scales, hidden)
    return Launch(EMBED_KQUANT[tensor_type], grid, (THREADS,), args)
