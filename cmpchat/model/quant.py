"""Q8_0 blocks and the int8 activation quantisation the GPU engine applies before each Q8_0 matmul.

A Q8_0 block is 32 weights stored as one fp16 scale `d` and 32 int8 values `q`; each weight is `d * q`.
Blocks run along the input dimension, so a row of `n` inputs holds `n / 32` blocks.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK
INT8_ACTIVATION_TYPES = frozenset(
    {
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
"""Weight types whose GPU matmuls take int8 activations (quantised as `quantize_activations` says): what the
reference's GPU-mirroring mode rounds the same way."""


def q8_0_split(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy views of a Q8_0 tensor's bytes: (scales fp16 [rows, cols/32], quants int8 [rows, cols/32, 32])."""
    blocks = raw.reshape(rows, cols // Q8_0_BLOCK, Q8_0_BLOCK_BYTES)
    scales = blocks[:, :, :2].view(np.float16)[:, :, 0]
    quants = blocks[:, :, 2:].view(np.int8)
    return scales, quants


def q8_0_dequantize(scales: np.ndarray, quants: np.ndarray) -> np.ndarray:
    """Exact float32 values of Q8_0 rows: scales [rows, nb] fp16, quants [rows, nb*32] or [rows, nb, 32]."""
    rows, nblocks = scales.shape
    q = quants.reshape(rows, nblocks, Q8_0_BLOCK).astype(np.float32)
    return (q * scales.astype(np.float32)[:, :, None]).reshape(rows, nblocks * Q8_0_BLOCK)


def q8_0_quantize(values: np.ndarray) -> np.ndarray:
    """Raw Q8_0 bytes [rows, cols/32*34] for float rows, rounding as llama.cpp does (amax / 127)."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    scale = amax / 127.0
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    quants = np.round(blocks * inverse[..., None]).astype(np.int8)
    out = np.empty((rows, cols // Q8_0_BLOCK, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :2] = scale.astype(np.float16)[..., None].view(np.uint8).reshape(rows, -1, 2)
    out[:, :, 2:] = quants.view(np.uint8)
    return out.reshape(rows, -1)


def int8_rounded(x: np.ndarray) -> np.ndarray:
    """x [..., n] as its int8 quantisation's values (`quantize_activations`), fp32."""
    quants, scales = quantize_activations(x)
    shape = x.shape
    blocks = quants.reshape(*shape[:-1], shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
    return (blocks * scales[..., None]).reshape(shape)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 per-32 quantisation of activations [..., n]: (quants int8 [..., n], scales fp32 [..., n/32]).

    This is the GPU engine's rule, mirrored exactly: scale = amax / 127 in fp32, q = round-half-even(x / scale).
    """
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
    scales = (np.abs(blocks).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1.0), scales)
    quants = np.rint(blocks / safe[..., None]).astype(np.int8)
    return quants.reshape(shape), scales
