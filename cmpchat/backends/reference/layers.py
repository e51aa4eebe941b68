"""Small numpy building blocks of the Qwen3.5 text model, all in fp32 (docs/model.md)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import Q8_0_BLOCK, quantize_activations

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
    """y = x @ W^T for one weight matrix of the file.

    Exact mode multiplies by the dequantised fp32 weight. GPU-mirroring mode does what the GPU engine does
    with a Q8_0 weight: quantise x to int8 per 32 values, take integer dot products per block and scale
    them by both block scales. Integer block sums stay below 2^24, so fp32 holds them exactly.
    """

    def __init__(self, model_file: ModelFile, name: str, *, mirror_gpu: bool) -> None:
        info = model_file.tensor_info(name)
        self.name = name
        self.out_features, self.in_features = info.shape
        self._int8_path = mirror_gpu and info.type == GGMLQuantizationType.Q8_0
        if self._int8_path:
            scales, quants = model_file.q8_0_parts(name)
            self._weight_scales = scales.astype(np.float32).T.copy()  # [blocks, out]
            self._block_quants = quants.astype(np.float32).transpose(1, 2, 0).copy()  # [blocks, 32, out]
        else:
            self._weight = model_file.dequantize(name)  # [out, in]; BLAS takes the transpose as is

    @property
    def host_bytes(self) -> int:
        """Host memory this layer keeps."""
        if self._int8_path:
            return self._weight_scales.nbytes + self._block_quants.nbytes
        return self._weight.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not self._int8_path:
            return x.astype(np.float32, copy=False) @ self._weight.T
        rows = x.shape[0]
        quants, scales = quantize_activations(x)
        quants = quants.reshape(rows, -1, Q8_0_BLOCK).astype(np.float32)
        out = np.zeros((rows, self.out_features), dtype=np.float32)
        for block in range(quants.shape[1]):
            dots = quants[:, block, :] @ self._block_quants[block]  # exact integers
            out += dots * (scales[:, block, None] * self._weight_scales[block][None, :])
        return out


def linear_weight_bytes(model_file: ModelFile, name: str) -> int:
    """fp32 bytes a `Linear` for this tensor holds in host memory."""
    out_features, in_features = model_file.tensor_info(name).shape
    return 4 * out_features * in_features
