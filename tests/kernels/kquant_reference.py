"""A numpy reading of the 4/5/6-bit GPU layout (`kernels/gemv_kquant.py`) for the tests: every value as the
kernels see it (S * q + M, in fp32 as the reader computes it) and |S q| + |M|, the magnitude the kernels'
tolerance scales with; plus random matrices of each type and int8 activations."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from cmpchat.backends.gpu.repack import repack_kquant
from cmpchat.kernels.gemv_kquant import FORMATS, KQuantArrays
from cmpchat.model.builder import random_blocks
from cmpchat.model.quant import quantize_activations


def decode_repacked(arrays: KQuantArrays, tensor_type: T, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(values float32 [rows, cols], |S q| + |M| float64 [rows, cols]) of a repacked matrix."""
    fmt = FORMATS[tensor_type]
    rows, blocks = arrays.nibbles.shape[0], cols // 32
    packed = np.ascontiguousarray(arrays.nibbles).view(np.uint8).reshape(rows, blocks, 16)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.uint32)  # [rows, blocks, 32]
    value = np.arange(32, dtype=np.uint32)
    w, i = value // 4, value % 4
    if fmt.high_bits == 1:
        q |= ((arrays.high.reshape(rows, blocks, 1) >> (8 * i + w)) & 1) << 4
    elif fmt.high_bits == 2:
        words = arrays.high.reshape(rows, blocks, 2)[:, :, w // 4]
        q |= ((words >> (8 * i + 2 * (w % 4))) & 3) << 4
    fields = arrays.scales.astype(np.float32).reshape(rows, -1, fmt.fields)
    per_block = fmt.group_values // 32
    d = np.repeat(fields[:, :, 0], per_block, axis=1)[:, :, None]  # [rows, blocks, 1]
    minimum = np.zeros_like(d)
    if fmt.sub_scales:
        sub = arrays.sub_scales.astype(np.int32)
        if fmt.split_scale:
            halves = np.stack([sub & 0xFF, sub >> 8], axis=-1).astype(np.uint8).view(np.int8)
            scale = d * np.repeat(halves.astype(np.float32), 16, axis=-1)
        else:
            scale = d * (sub & 0xFF).astype(np.float32)[:, :, None]
            minimum = -(
                np.repeat(fields[:, :, 1], per_block, axis=1)[:, :, None] * (sub >> 8).astype(np.float32)[:, :, None]
            )
    else:
        scale = d
        if fmt.has_min:
            minimum = fields[:, :, 1][:, :, None]
    levels = q.astype(np.float32) - np.float32(fmt.offset)
    values = scale * levels + minimum if fmt.has_min else scale * levels
    magnitude = np.abs(scale.astype(np.float64) * levels) + np.abs(minimum.astype(np.float64))
    return values.reshape(rows, cols), magnitude.reshape(rows, cols)


def random_matrix(rng: np.random.Generator, tensor_type: T, rows: int, cols: int) -> tuple[np.ndarray, KQuantArrays]:
    """Random valid blocks (the model builder's) as the file stores them and as the GPU layout."""
    raw = random_blocks(rng, tensor_type, rows, cols)
    return raw, repack_kquant(raw, tensor_type, cols)


def int8_activations(rng: np.random.Generator, tokens: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(quants uint32 [T, cols/4], scales fp32 [T, cols/32], their values float64 [T, cols])."""
    quants, scales = quantize_activations(rng.standard_normal((tokens, cols)).astype(np.float32))
    values = (quants.reshape(tokens, -1, 32) * scales[..., None].astype(np.float64)).reshape(tokens, cols)
    return np.ascontiguousarray(quants).view(np.uint32), scales, values
