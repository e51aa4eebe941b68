"""Quantised weights regrouped for the GPU: quants and scales apart, so kernels use aligned 16-byte loads.

A file's Q8_0 rows interleave a 2-byte scale with 32 quants (34-byte blocks, so quants are never 16-byte
aligned). The GPU layout keeps all quants of a matrix contiguous ([rows, cols] int8) and the fp16 scales
in their own [rows, cols/32] array. The 4/5/6-bit types are split into nibbles, high bits, sub-block scales
and fp16 fields (`kernels/gemv_kquant.py` describes the layout). Rows are produced in bounded chunks so host
RAM stays small.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from cmpchat.kernels.gemv_kquant import FORMATS, KQuantArrays
from cmpchat.model.dequant import BLOCK_FORMATS
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import Q8_0_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class RowChunk:
    first_row: int
    quants: np.ndarray  # int8 [rows, cols], C-contiguous
    scales: np.ndarray  # float16 [rows, cols/32], C-contiguous


def q8_0_row_chunks(model_file: ModelFile, name: str, max_bytes: int) -> Iterator[RowChunk]:
    """The Q8_0 matrix `name` in GPU layout, a few rows at a time (each chunk at most ~`max_bytes`)."""
    rows, cols = model_file.tensor_info(name).shape
    scales, quants = model_file.q8_0_parts(name)
    row_bytes = cols // 32 * Q8_0_BLOCK_BYTES
    step = max(1, max_bytes // row_bytes)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        yield RowChunk(
            first_row=first,
            quants=np.ascontiguousarray(quants[first:last]).reshape(last - first, cols),
            scales=np.ascontiguousarray(scales[first:last]),
        )


@dataclass(frozen=True, slots=True)
class KQuantChunk:
    first_row: int
    arrays: KQuantArrays  # numpy arrays of the chunk's rows, C-contiguous


def kquant_row_chunks(model_file: ModelFile, name: str, max_bytes: int) -> Iterator[KQuantChunk]:
    """The 4/5/6-bit matrix `name` in GPU layout (`kernels/gemv_kquant.py`), a few rows at a time (each chunk
    read from at most ~`max_bytes` of the file)."""
    info = model_file.tensor_info(name)
    raw = model_file.raw_rows(name)
    step = max(1, max_bytes // raw.shape[1])
    for first in range(0, raw.shape[0], step):
        yield KQuantChunk(first, repack_kquant(raw[first : first + step], info.type, info.shape[1]))


def repack_kquant(raw_rows: np.ndarray, tensor_type: T, cols: int) -> KQuantArrays:
    """Rows of a file's blocks, uint8 [rows, row bytes], in the GPU layout of `kernels/gemv_kquant.py`."""
    fmt = FORMATS[tensor_type]
    rows = raw_rows.shape[0]
    block = BLOCK_FORMATS[tensor_type]
    blocks = np.ascontiguousarray(raw_rows, dtype=np.uint8).reshape(-1, block.nbytes)
    q = _unsigned_quants(blocks, tensor_type).reshape(-1, 2, 16)  # [32-blocks, halves, 16]
    nibbles = (q[:, 0] & 0x0F) | ((q[:, 1] & 0x0F) << 4)
    shapes = fmt.shapes(rows, cols)
    arrays = {"nibbles": nibbles.view(np.uint32)}
    if fmt.high_bits:
        arrays["high"] = _high_words(q.reshape(-1, 8, 4) >> 4, fmt.high_bits)
    if fmt.sub_scales:
        arrays["sub_scales"] = _sub_scales(blocks, tensor_type)
    arrays["scales"] = _fp16_fields(blocks, tensor_type, fmt.fields)
    placeholder = {"high": np.zeros((1, 1), np.uint32), "sub_scales": np.zeros((1, 1), np.uint16)}
    shaped = {
        name: np.ascontiguousarray(arrays[name]).reshape(shape) if name in arrays else placeholder[name]
        for name, shape in shapes.items()
    }
    return KQuantArrays(**shaped)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2k]: the k low nibbles, then the k high nibbles (the file's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bits_32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of 32 bits -> [n, 32] values 0 or 16 (bit j: value j)."""
    return (((qh.view("<u4").astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _unsigned_quants(blocks: np.ndarray, tensor_type: T) -> np.ndarray:
    """Every value's q (all its bits, before any offset) in the file's value order, uint8 [n, block values]."""
    n = len(blocks)
    if tensor_type in (T.Q4_0, T.Q4_1):
        start = 2 if tensor_type == T.Q4_0 else 4
        return _nibbles(blocks[:, start : start + 16])
    if tensor_type in (T.Q5_0, T.Q5_1):
        start = 2 if tensor_type == T.Q5_0 else 4
        return _nibbles(blocks[:, start + 4 : start + 20]) | _bits_32(blocks[:, start : start + 4])
    if tensor_type == T.Q4_K:
        return _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 256)
    if tensor_type == T.Q5_K:
        low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
        high = ((blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
        return (low | high).reshape(n, 256)
    assert tensor_type == T.Q6_K
    low = _nibbles(blocks[:, 0:128].reshape(n, 2, 64))
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128) << 4
    return (low | high).reshape(n, 256)


def _high_words(high: np.ndarray, bits: int) -> np.ndarray:
    """High bits [32-blocks, 8 words w, 4 bytes i] -> uint32 [32-blocks, bits]: Q5 bit 8i + w; Q6_K word w // 4,
    bits 8i + 2 (w % 4)."""
    high = high.astype(np.uint32)
    byte = 8 * np.arange(4, dtype=np.uint32)[None, None, :]
    if bits == 1:
        return (high << (byte + np.arange(8, dtype=np.uint32)[None, :, None])).sum(axis=(1, 2), dtype=np.uint32)[
            :, None
        ]
    pairs = high.reshape(-1, 2, 4, 4)  # [blocks, word, w % 4, i]
    shift = byte[:, :, None, :] + 2 * np.arange(4, dtype=np.uint32)[None, None, :, None]
    return (pairs << shift).sum(axis=(2, 3), dtype=np.uint32)


def _sub_scales(blocks: np.ndarray, tensor_type: T) -> np.ndarray:
    """uint16 [n, sub-blocks of 32]: Q4_K / Q5_K sc | m << 8, Q6_K its two int8 scales (first half low)."""
    if tensor_type == T.Q6_K:
        return blocks[:, 192:208].copy().view("<u2")
    packed = blocks[:, 4:16]
    low_scales, low_mins, nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low_scales & 0x3F, (nibbles & 0x0F) | ((low_scales >> 6) << 4)], axis=1)
    mins = np.concatenate([low_mins & 0x3F, (nibbles >> 4) | ((low_mins >> 6) << 4)], axis=1)
    return scales.astype(np.uint16) | (mins.astype(np.uint16) << 8)


def _fp16_fields(blocks: np.ndarray, tensor_type: T, fields: int) -> np.ndarray:
    """The blocks' fp16 d (and dmin or m), [n, fields]."""
    start = 208 if tensor_type == T.Q6_K else 0
    return blocks[:, start : start + 2 * fields].copy().view(np.float16)
