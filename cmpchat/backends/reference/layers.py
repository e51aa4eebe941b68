"""Small numpy building blocks of the Qwen3.5 text model, all in fp32 (docs/model.md)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from cmpchat.model.dequant import dequantize_rows
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import INT8_ACTIVATION_TYPES, Q8_0_BLOCK, int8_rounded, q8_0_split, quantize_activations

L2_NORM_EPS = 1e-6  # GDN's q/k L2 normalisation: x / sqrt(sum(x^2) + eps)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis; the GGUF weight is already multiplicative."""
    x = x.astype(np.float32, copy=False)
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * scale * weight).astype(np.float32, copy=False)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_NORM_EPS))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) without overflow for large x.
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


def rope_angles(positions: np.ndarray, rope_dims: int, theta: float, sections: tuple[int, ...]) -> np.ndarray:
    """Rotation angles [T, rope_dims/2] for (t, h, w) positions [T, 3] with interleaved multimodal RoPE.

    Frequency i takes the height position when i % 3 == 1 and i < 3 * sections[1], the width position when
    i % 3 == 2 and i < 3 * sections[2], else the temporal position. Text has t == h == w: plain RoPE.
    """
    half = rope_dims // 2
    index = np.arange(half)
    inv_freq = theta ** (-2.0 * index / rope_dims)
    axis = np.zeros(half, dtype=np.int64)
    axis[(index % 3 == 1) & (index < 3 * sections[1])] = 1
    axis[(index % 3 == 2) & (index < 3 * sections[2])] = 2
    chosen = positions[:, axis].astype(np.float64)  # [T, half]
    return (chosen * inv_freq).astype(np.float32)


def apply_rope(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """NeoX half-split rotation of the first 2*angles.shape[-1] dims of each head; x is [T, heads, head_dim]."""
    half = angles.shape[-1]
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out


class Linear:
    """y = x @ W^T for one weight matrix of the file, of any type the reader reads.

    A new Linear keeps its weight packed: a view of the mapped file's bytes, dequantised a block of rows at a
    time in each call (no memory beyond the file's pages, slow). `unpack()` holds it in host memory instead,
    ready to multiply (4 bytes a weight); the backend unpacks every matrix when they all fit in RAM.

    Exact mode multiplies by the exact fp32 values of the weight (`cmpchat.model.dequant`). GPU-mirroring mode
    does what the GPU engine does with a Q8_0 weight: quantise x to int8 per 32 values, take integer dot
    products per block and scale them by both block scales. Integer block sums stay below 2^24, so fp32 holds
    them exactly and packed and unpacked give the same bits. For the 4/5/6-bit types it multiplies the exact
    weights by x rounded to int8 as the GPU quantises it (the GPU's sums then differ only in fp32 order); float
    weights take the exact path in both modes.
    """

    ROW_BLOCK_VALUES = 1 << 22
    """Weights a packed Linear dequantises at once (16 MiB of fp32)."""

    def __init__(self, model_file: ModelFile, name: str, *, mirror_gpu: bool) -> None:
        info = model_file.tensor_info(name)
        self.name = name
        self.tensor_type = info.type
        self.file_bytes = info.n_bytes
        self.out_features, self.in_features = info.shape
        self._int8_path = mirror_gpu and info.type == GGMLQuantizationType.Q8_0
        self._rounds_input = mirror_gpu and info.type in INT8_ACTIVATION_TYPES  # 4/5/6-bit: x to int8 first
        self._packed: np.ndarray | None = model_file.raw_rows(name)  # [out, bytes a row], a view of the file
        self._weight: np.ndarray | None = None  # exact path, unpacked: [out, in]
        self._int8: tuple[np.ndarray, np.ndarray] | None = None  # int8 path, unpacked: see `_int8_parts`

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def unpacked_bytes(self) -> int:
        """Host memory this layer holds once unpacked."""
        return 4 * self.out_features * self.in_features

    @property
    def host_bytes(self) -> int:
        """Host memory this layer holds now (packed: none, the weight stays in the mapped file)."""
        return 0 if self.packed else self.unpacked_bytes

    def unpack(self) -> None:
        """Hold the weight in host memory, ready to multiply, and drop the view of the file."""
        if self._packed is None:
            return
        if self._int8_path:
            self._int8 = self._int8_parts(self._packed)
        else:
            self._weight = dequantize_rows(self._packed, self.tensor_type, self.in_features)  # BLAS takes .T as is
        self._packed = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        if self._int8_path:
            return self._int8_matmul(x)
        if self._rounds_input:
            x = int8_rounded(x)
        if self._weight is not None:
            return x @ self._weight.T
        assert self._packed is not None
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        for rows in self._row_blocks():
            weight = dequantize_rows(self._packed[rows], self.tensor_type, self.in_features)
            out[:, rows] = x @ weight.T
        return out

    def _row_blocks(self) -> list[slice]:
        step = max(1, self.ROW_BLOCK_VALUES // self.in_features)
        return [slice(start, min(start + step, self.out_features)) for start in range(0, self.out_features, step)]

    def _int8_parts(self, raw_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Q8_0 rows as (scales fp32 [blocks, rows], quants fp32 [blocks, 32, rows]) for `_int8_dots`."""
        scales, quants = q8_0_split(np.ascontiguousarray(raw_rows), len(raw_rows), self.in_features)
        return scales.astype(np.float32).T.copy(), quants.astype(np.float32).transpose(1, 2, 0).copy()

    def _int8_matmul(self, x: np.ndarray) -> np.ndarray:
        quants, scales = quantize_activations(x)
        quants = quants.reshape(x.shape[0], -1, Q8_0_BLOCK).astype(np.float32)
        if self._int8 is not None:
            return _int8_dots(quants, scales, *self._int8)
        assert self._packed is not None
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        for rows in self._row_blocks():
            out[:, rows] = _int8_dots(quants, scales, *self._int8_parts(self._packed[rows]))
        return out


def _int8_dots(
    x_quants: np.ndarray, x_scales: np.ndarray, weight_scales: np.ndarray, weight_quants: np.ndarray
) -> np.ndarray:
    """Σ over blocks of (exact integer dot product) · (activation scale · weight scale), in block order.

    x_quants fp32 [rows, blocks, 32], x_scales [rows, blocks]; weight_scales [blocks, out],
    weight_quants [blocks, 32, out]."""
    out = np.zeros((x_quants.shape[0], weight_scales.shape[1]), dtype=np.float32)
    for block in range(x_quants.shape[1]):
        dots = x_quants[:, block, :] @ weight_quants[block]  # exact integers
        out += dots * (x_scales[:, block, None] * weight_scales[block][None, :])
    return out


def unpack_if_fits(linears: list[Linear], available: int | None) -> bool:
    """Unpack every matrix when their fp32 weights fit in 90% of `available` bytes of RAM (None: unknown, so
    unpack); otherwise leave them all packed. Returns whether they were unpacked."""
    needed = sum(linear.unpacked_bytes for linear in linears)
    if available is not None and needed > 0.9 * available:
        return False
    for linear in linears:
        linear.unpack()
    return True


def linear_weight_bytes(model_file: ModelFile, name: str) -> int:
    """fp32 bytes a `Linear` for this tensor holds in host memory once unpacked."""
    out_features, in_features = model_file.tensor_info(name).shape
    return 4 * out_features * in_features
