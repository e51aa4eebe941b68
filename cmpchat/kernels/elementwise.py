"""Elementwise glue of the decode step, and the fp32 device functions kernel modules share.

- `embed_q8_0`: token ids (in device memory, so a captured graph serves any tokens) -> fp32 hidden rows,
  dequantised exactly (int8 * fp16 scale, one rounding, as `q8_0_dequantize`), from the GEMV's repacked
  Q8_0 layout (`gemv.repack_q8_0`). A row whose id is `PLACED_ROW` is left as it is: the backend copied an
  image's hidden row there before the step, which stands in for the embedding of its `<|image_pad|>` token
  (no second buffer and no copy kernel; the graphs stay the same for prompts with and without images).
- `silu`, `sigmoid`, `softplus`: written as the reference writes them, in fp32.

No residual add or SwiGLU kernel: the GEMV's epilogues do both (accumulate into the residual stream after
attn_output / ssm_out / ffn_down; SwiGLU on the stacked gate|up weight).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import allow_dependent_grids, wait_for_prior_grids
from cmpchat.cudart.launch import Launch, check_array

_ZERO = float32(0.0)
_ONE = float32(1.0)
_THREADS = 128
Q8_0_BLOCK = 32
_WORDS_PER_BLOCK = Q8_0_BLOCK // 4
PLACED_ROW = -2
"""A token id that tells `embed_q8_0` its row already holds the row's hidden state (an image row)."""


# -- shared fp32 device functions (math results cast back: the simulator's math returns Python floats) --


@cuda.jit(device=True, inline=True)
def silu(x):
    return x / (_ONE + float32(math.exp(-x)))


@cuda.jit(device=True, inline=True)
def sigmoid(x):
    return _ONE / (_ONE + float32(math.exp(-x)))


@cuda.jit(device=True, inline=True)
def softplus(x):
    # log(1 + e^x) = max(x, 0) + log1p(e^-|x|), as numpy's logaddexp(0, x): no overflow for large x.
    return max(x, _ZERO) + float32(math.log1p(math.exp(-abs(x))))


@cuda.jit(device=True, inline=True)
def _signed_byte(word, shift):
    byte = int32((word >> shift) & 0xFF)
    return byte - ((byte & 0x80) << 1)


# -- kernels -----------------------------------------------------------------------------------------


@kernel("void(int32[::1], uint32[:, ::1], float16[:, ::1], float32[:, ::1])", early_launch=True)
def embed_q8_0_kernel(token_ids, quants, scales, hidden):
    """Block (word group, row); thread = one 32-bit word = 4 int8 weights of the token's row."""
    wait_for_prior_grids()
    allow_dependent_grids()
    word = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row = cuda.blockIdx.y
    if word >= quants.shape[1]:
        return
    token = token_ids[row]
    if token == PLACED_ROW:
        return
    column = 4 * word
    if token < 0 or token >= quants.shape[0]:  # idle row (or a bad id): zeros, never a wild read
        for i in range(4):
            hidden[row, column + i] = _ZERO
        return
    packed = quants[token, word]
    scale = float32(scales[token, word // _WORDS_PER_BLOCK])
    for i in range(4):
        hidden[row, column + i] = float32(_signed_byte(packed, 8 * i)) * scale


# -- launchers ---------------------------------------------------------------------------------------


def embed_q8_0(token_ids: Any, quants: Any, scales: Any, hidden: Any) -> Launch:
    """hidden[b] = dequantised embedding row token_ids[b]; a row of id `PLACED_ROW` keeps what it holds, any
    other negative id gives a zero row.

    token_ids [B] int32; quants [V, d/4] uint32: the int8 [V, d] weights as little-endian words (byte i of
    word w is weight 4w+i); scales [V, d/32] fp16; hidden [B, d] fp32. All C-contiguous.
    """
    (batch,) = check_array(token_ids, "token_ids", np.int32, 1)
    vocab, words = check_array(quants, "quants", np.uint32, 2)
    if words % _WORDS_PER_BLOCK:
        raise ValueError(f"embedding width {4 * words} is not a multiple of {Q8_0_BLOCK}")
    check_array(scales, "scales", np.float16, 2, (vocab, words // _WORDS_PER_BLOCK))
    check_array(hidden, "hidden", np.float32, 2, (batch, 4 * words))
    blocks = -(-words // _THREADS)
    return Launch(embed_q8_0_kernel, (blocks, batch), (_THREADS,), (token_ids, quants, scales, hidden))
