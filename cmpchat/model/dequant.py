"""Exact float32 values of the GGUF tensor types cmpchat reads: plain floats, Q8_0, the legacy 4/5-bit blocks,
the k-quants and the 4-bit non-linear types (docs/model.md, "Weights").

Every block type stores its values along a row's input dimension in blocks of 32 or 256, each with its own fp16
scale (and for some types a minimum, or 6- or 8-bit sub-block scales). The layouts follow ggml's (the `gguf`
package's constants and llama.cpp's ggml-quants give the facts); the code here is cmpchat's own, vectorised over
blocks. Every result is computed in the same order as ggml's dequantisation, and every product of a scale and
an integer is exact in fp32, so the values are those ggml would produce, bit for bit
(tests/model/test_dequant.py checks each type against `gguf.quants.dequantize`).

Layouts, one block each (offsets in bytes, fp16 little-endian; "nibbles" of 16 bytes are the low nibbles of the
16 bytes, values 0-15, then their high nibbles, values 16-31):

| type | values | bytes | layout | value |
|---|---|---|---|---|
| Q4_0 | 32 | 18 | d, nibbles | d · (q − 8) |
| Q4_1 | 32 | 20 | d, m, nibbles | d · q + m |
| Q5_0 | 32 | 22 | d, qh (32 high bits, bit j for value j), nibbles | d · (q − 16) |
| Q5_1 | 32 | 24 | d, m, qh, nibbles | d · q + m |
| Q8_0 | 32 | 34 | d, 32 int8 | d · q |
| Q4_K | 256 | 144 | d, dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of 32), 128 bytes of 4-bit q | (d · sc) · q − (dmin · m) |
| Q5_K | 256 | 176 | as Q4_K, then 32 bytes of high bits before the 128 of low nibbles | (d · sc) · q − (dmin · m) |
| Q6_K | 256 | 210 | 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (per 16 values), d | (d · sc) · (q − 32) |
| IQ4_NL | 32 | 18 | d, nibbles | d · table[q] |
| IQ4_XS | 256 | 136 | d, 16-bit high scale bits, 4 bytes of low scale nibbles, 128 bytes of nibbles | (d · (ls − 32)) · table[q] |

Q4_K / Q5_K values run in four 64-value groups; group c takes the low nibbles of its 32 bytes for sub-block 2c
and the high nibbles for sub-block 2c + 1 (Q5_K's high bit of value l of sub-block j is bit j of high-bit byte l).
Q6_K runs in two 128-value halves, each from 64 bytes of nibbles and 32 of high bits: values 0-31 the low nibbles
of bytes 0-31 with bits 0-1 of the high bytes, 32-63 bytes 32-63's low nibbles with bits 2-3, 64-95 bytes 0-31's
high nibbles with bits 4-5, 96-127 bytes 32-63's high nibbles with bits 6-7; value e's scale is sc[e // 16].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
"""The 16 levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl)."""

CHUNK_VALUES = 1 << 16
"""Values dequantised at once: a chunk's temporaries stay in the CPU's caches (about 3x faster than whole
tensors at once, whose temporaries are fresh memory)."""


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One block type: `values` weights stored in `nbytes` bytes; `dequantize` maps uint8 [n, nbytes] blocks to
    float32 [n, values]."""

    tensor_type: T
    values: int
    nbytes: int
    dequantize: Callable[[np.ndarray], np.ndarray]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at `offset` of every block, as float32 [n, 1] (exact)."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2k] values: the k low nibbles, then the k high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:18]).astype(np.float32) - np.float32(8)
    return _f16(blocks, 0) * q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes holding 32 bits (little-endian) -> [n, 32] values 0 or 16, bit j for value j."""
    bits = qh.view("<u4").astype(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 6:22]) | _high_bits_32(blocks[:, 2:6])).astype(np.float32) - np.float32(16)
    return _f16(blocks, 0) * q


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 8:24]) | _high_bits_32(blocks[:, 4:8])).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * blocks[:, 2:34].view(np.int8).astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> (scales, mins), each uint8 [n, 8] of 6 bits.

    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take the nibbles of
    bytes 8-11 (low: scale, high: min) as their low 4 bits and the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
    """
    low_scales, low_mins, nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low_scales & 0x3F, (nibbles & 0x0F) | ((low_scales >> 6) << 4)], axis=1)
    mins = np.concatenate([low_mins & 0x3F, (nibbles >> 4) | ((low_mins >> 6) << 4)], axis=1)
    return scales, mins


def _k_scale_factors(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d · sc, dmin · m) per sub-block, float32 [n, 8, 1] (both products exact)."""
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales.astype(np.float32))[:, :, None]
    m = (_f16(blocks, 2) * mins.astype(np.float32))[:, :, None]
    return d, m


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    d, m = _k_scale_factors(blocks)
    return (d * q - m).reshape(n, QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = ((blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4  # [n, 8, 32]
    q = (low | high).astype(np.float32)
    d, m = _k_scale_factors(blocks)
    return (d * q - m).reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    low = _nibbles(blocks[:, 0:128].reshape(n, 2, 64))  # [n, 2, 128]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128) << 4
    q = (low | high).astype(np.float32) - np.float32(32)
    d = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16], exact
    return (d[:, :, None] * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * IQ4_TABLE[_nibbles(blocks[:, 2:18])]


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    low = blocks[:, 4:8]
    low_bits = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(n, 8)  # sub-block 2i: low nibble of byte i
    high = blocks[:, 2:4].view("<u2").astype(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    scales = (low_bits | ((high & 3) << 4)).astype(np.float32) - np.float32(32)  # [n, 8]
    d = (_f16(blocks, 0) * scales)[:, :, None]
    values = IQ4_TABLE[_nibbles(blocks[:, 8:136].reshape(n, 8, 16))]  # [n, 8, 32]
    return (d * values).reshape(n, QK_K)


BLOCK_FORMATS: dict[T, BlockFormat] = {
    f.tensor_type: f
    for f in [
        BlockFormat(T.Q4_0, 32, 18, _q4_0),
        BlockFormat(T.Q4_1, 32, 20, _q4_1),
        BlockFormat(T.Q5_0, 32, 22, _q5_0),
        BlockFormat(T.Q5_1, 32, 24, _q5_1),
        BlockFormat(T.Q8_0, 32, 34, _q8_0),
        BlockFormat(T.Q4_K, QK_K, 144, _q4_k),
        BlockFormat(T.Q5_K, QK_K, 176, _q5_k),
        BlockFormat(T.Q6_K, QK_K, 210, _q6_k),
        BlockFormat(T.IQ4_NL, 32, 18, _iq4_nl),
        BlockFormat(T.IQ4_XS, QK_K, 136, _iq4_xs),
    ]
}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
READABLE_TYPES = (*FLOAT_TYPES, *BLOCK_FORMATS)
"""Every tensor type cmpchat reads (on the CPU; the CUDA backend runs a subset, `backends/gpu/weights.py`)."""


def type_names(types: tuple[T, ...] | list[T]) -> str:
    return ", ".join(t.name for t in types)


def row_bytes(tensor_type: T, cols: int) -> int:
    """Bytes of one row of `cols` values; `cols` must be a whole number of blocks."""
    if tensor_type in BLOCK_FORMATS:
        block = BLOCK_FORMATS[tensor_type]
        return cols // block.values * block.nbytes
    return cols * {T.F32: 4, T.F16: 2, T.BF16: 2}[tensor_type]


def dequantize_blocks(blocks: np.ndarray, tensor_type: T) -> np.ndarray:
    """uint8 [n, block bytes] -> float32 [n, block values], exactly."""
    block = BLOCK_FORMATS[tensor_type]
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block.nbytes)
    return block.dequantize(blocks).astype(np.float32, copy=False)


def dequantize_rows(raw: np.ndarray, tensor_type: T, cols: int) -> np.ndarray:
    """Rows of a tensor's bytes, uint8 [rows, row bytes], -> float32 [rows, cols], exactly."""
    rows = raw.shape[0]
    if tensor_type in FLOAT_TYPES:
        return _float_rows(raw, tensor_type, cols)
    block = BLOCK_FORMATS[tensor_type]
    blocks = raw.reshape(-1, block.nbytes)
    out = np.empty((len(blocks), block.values), dtype=np.float32)
    step = CHUNK_VALUES // block.values
    for start in range(0, len(blocks), step):
        chunk = np.ascontiguousarray(blocks[start : start + step])
        out[start : start + len(chunk)] = block.dequantize(chunk)
    return out.reshape(rows, cols)


def _float_rows(raw: np.ndarray, tensor_type: T, cols: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw)
    if tensor_type == T.F32:
        return raw.view(np.float32).reshape(-1, cols)
    if tensor_type == T.F16:
        return raw.view(np.float16).reshape(-1, cols).astype(np.float32)
    # bf16 is the top half of an fp32: shift it back into place.
    return (raw.view(np.uint16).reshape(-1, cols).astype(np.uint32) << 16).view(np.float32)
