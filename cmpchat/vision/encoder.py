"""The Qwen3.5 image encoder in numpy: the reference the GPU kernels are checked against.

Patch embedding (the Conv3d over a 16-px patch and its temporal pair is one matrix product), plus the learned
position table resampled bilinearly (corners aligned) to the image's grid; then ViT blocks with LayerNorm,
bidirectional attention over the image's patches with 2-D rotary embeddings (half of each head's frequencies
turn with the patch row, half with the column) and a GELU-tanh MLP; then the merger: LayerNorm, each 2x2 group
of patches side by side, a GELU (erf) MLP to the text width. Patches arrive in merge-group order
(`preprocess.prepare_image`), so a group is four consecutive rows. Computed in float32 like transformers' fp32
forward.
"""

from __future__ import annotations

import math

import numpy as np

from cmpchat.vision.mmproj import Projector, VisionBlockWeights, VisionConfig
from cmpchat.vision.preprocess import Grid, PreparedImage

_erf = np.frompyfunc(math.erf, 1, 1)


def encode_image(projector: Projector, image: PreparedImage) -> np.ndarray:
    """float32 [merged tokens, text width]: the rows that replace the image's `<|image_pad|>` embeddings."""
    return merge_patches(projector, patch_states(projector, image))


def patch_states(projector: Projector, image: PreparedImage) -> np.ndarray:
    """float32 [patches, width]: the last block's output."""
    config, weights = projector.config, projector.weights
    flat_kernel = weights.patch_weight.reshape(config.width, -1)
    states = image.pixel_values @ flat_kernel.T + weights.patch_bias
    rows, cols = patch_coordinates(image.grid, config.merge_size)
    states = states + resampled_positions(weights.position_embedding, config.position_grid, image.grid, rows, cols)
    cos, sin = rotary_tables(rows, cols, config)
    for block in weights.blocks:
        states = states + _attention(
            block, _layer_norm(states, block.ln1_weight, block.ln1_bias, config), cos, sin, config
        )
        hidden = _layer_norm(states, block.ln2_weight, block.ln2_bias, config) @ block.up_weight.T + block.up_bias
        states = states + _gelu_tanh(hidden) @ block.down_weight.T + block.down_bias
    return states.astype(np.float32)


def merge_patches(projector: Projector, states: np.ndarray) -> np.ndarray:
    """float32 [patches / 4, text width]: the merger over consecutive groups of merge_size**2 patches."""
    config, weights = projector.config, projector.weights
    normed = _layer_norm(states, weights.post_ln_weight, weights.post_ln_bias, config)
    grouped = normed.reshape(-1, config.merged_width)
    hidden = _gelu_erf(grouped @ weights.merger_fc1_weight.T + weights.merger_fc1_bias)
    return (hidden @ weights.merger_fc2_weight.T + weights.merger_fc2_bias).astype(np.float32)


def patch_coordinates(grid: Grid, merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every patch, in merge-group order, repeated for each frame."""
    m = merge_size
    index = np.arange(grid.rows * grid.cols)
    groups_per_row = grid.cols // m
    group, within = np.divmod(index, m * m)
    rows = (group // groups_per_row) * m + within // m
    cols = (group % groups_per_row) * m + within % m
    return np.tile(rows, grid.frames), np.tile(cols, grid.frames)


def resampled_positions(table: np.ndarray, side: int, grid: Grid, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float32 [patches, width]: the side x side position table, bilinear with corners aligned, at each patch."""
    row_taps, row_weights = _bilinear_taps(rows, grid.rows, side)
    col_taps, col_weights = _bilinear_taps(cols, grid.cols, side)
    out = np.zeros((rows.size, table.shape[1]), dtype=np.float32)
    for i in range(2):
        for j in range(2):
            weight = (row_weights[:, i] * col_weights[:, j])[:, None]
            out += table[row_taps[:, i] * side + col_taps[:, j]] * weight
    return out


def _bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    # Corners aligned: target 0 and size-1 land on source 0 and side-1.
    source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(source)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(source[:, None] - floor[:, None] - np.arange(2)), 0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1), weights


def rotary_tables(rows: np.ndarray, cols: np.ndarray, config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [patches, head_dim]: [row angles | column angles] twice, for a half-split rotation."""
    quarter = config.head_dim // 4
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
    inv_freq = inv_freq.astype(np.float32)
    angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=1).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles), np.sin(angles)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attention(
    block: VisionBlockWeights, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, config: VisionConfig
) -> np.ndarray:
    n, h, hd = x.shape[0], config.num_heads, config.head_dim
    qkv = (x @ block.qkv_weight.T + block.qkv_bias).reshape(n, 3, h, hd)
    q = _rotate(qkv[:, 0], cos[:, None], sin[:, None])
    k = _rotate(qkv[:, 1], cos[:, None], sin[:, None])
    v = qkv[:, 2]
    out = np.empty((n, h, hd), dtype=np.float32)
    # One head at a time: the score matrix of a large image is patches^2.
    for head in range(h):
        scores = (q[:, head] @ k[:, head].T) * np.float32(hd**-0.5)
        scores = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = (scores / scores.sum(axis=1, keepdims=True)) @ v[:, head]
    return out.reshape(n, h * hd) @ block.out_weight.T + block.out_bias


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, config: VisionConfig) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(variance + np.float32(config.layer_norm_eps)) * weight + bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x**3)))


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    erf = np.asarray(_erf(x.astype(np.float64) / math.sqrt(2)), dtype=np.float64)
    return (0.5 * x * (1 + erf)).astype(np.float32)
