"""Decode attention over a compressed cache (`kernels/attention_compressed.py`) under the simulator: a cache
written by the GPU's `kv_write`, attended by the GPU kernels, against the reference's cache in the same format
(`PagedKv`, encoded by `kv_formats`) attended in the rotated domain (`attend_rotated`) and decoded first
(`attend`). The two sides hold the same codes (test_kv_write.py), so they differ only in fp32 summation order:
within 1e-4 of the output's largest magnitude (measured: under 3e-6)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.reference.attention import PagedKv, attend, attend_rotated
from cmpchat.backends.reference.layers import sigmoid
from cmpchat.kernels.attention import DecodeAttentionConfig, partial_buffer_shapes
from cmpchat.kernels.attention_compressed import compressed_decode_attention
from cmpchat.kernels.kv_codes import GPU_FORMATS
from cmpchat.kernels.kv_write import kv_write_launch
from cmpchat.kv_formats import FORMATS
from tests.kernels.test_attention import attention_config

TOLERANCE = 1e-4


@dataclass
class CompressedCase:
    """Sequences of `lengths` tokens (0: an inactive row) in shuffled pages; the last token of each is the step's."""

    format_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    lengths: list[int]
    page_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        hkv, hd, rows = self.num_kv_heads, self.head_dim, len(self.lengths)
        pages_per_row = max(-(-max(n, 1) // self.page_tokens) for n in self.lengths)
        self.num_pages = rows * pages_per_row + 1
        self.page_table = rng.permutation(self.num_pages)[: rows * pages_per_row].astype(np.int32)
        self.page_table = self.page_table.reshape(rows, pages_per_row)
        self.keys = [(rng.standard_normal((n, hkv, hd)) * rng.uniform(0.5, 2)).astype(np.float32) for n in self.lengths]
        self.values = [rng.standard_normal((n, hkv, hd)).astype(np.float32) for n in self.lengths]
        self.q = (rng.standard_normal((rows, self.num_heads, hd)) * 2).astype(np.float32)
        width = 2 * (self.num_heads + hkv) * hd
        self.qkv = rng.standard_normal((rows, width)).astype(np.float32)
        self.positions = np.zeros((rows, 4), np.int32)
        self.positions[:, 0] = np.array(self.lengths) - 1

    def write_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every token of every sequence as one row of a `kv_write` launch: k_rows, qkv, positions, page table."""
        hkv, hd = self.num_kv_heads, self.head_dim
        tokens = sum(self.lengths)
        k_rows = np.concatenate(self.keys) if tokens else np.zeros((0, hkv, hd), np.float32)
        qkv = np.zeros((tokens, self.qkv.shape[1]), np.float32)
        qkv[:, -hkv * hd :] = np.concatenate(self.values).reshape(tokens, -1)
        positions = np.zeros((tokens, 4), np.int32)
        positions[:, 0] = np.concatenate([np.arange(n) for n in self.lengths])
        table = np.repeat(self.page_table, self.lengths, axis=0)
        return k_rows, qkv, positions, table

    def empty_caches(self) -> list[np.ndarray]:
        arrays: list[np.ndarray] = []
        for codec in GPU_FORMATS[self.format_name]:
            lead = (self.num_pages, self.page_tokens, self.num_kv_heads)
            arrays += [np.zeros((*lead, codec.codes_per_vector(self.head_dim)), codec.code_dtype),
                       np.zeros((*lead, codec.scales_per_vector(self.head_dim)), codec.scale_dtype)]  # fmt: skip
        return arrays

    def reference(self, row: int, *, rotated: bool) -> np.ndarray:
        """The reference's gated attention output [H * hd] of `row`'s step over its cache in the format."""
        config = attention_config(self.num_heads, self.num_kv_heads, self.head_dim, 32, (6, 5, 5, 0))
        length = self.lengths[row]
        kv_format = FORMATS[self.format_name]
        kv = PagedKv(config, length, kv_format, rotated_attention=rotated)
        kv.write(0, [0], 0, self.keys[row], self.values[row])
        query = self.q[row : row + 1]
        if rotated:
            attended = attend_rotated(query, *kv.read_rotated(0, [0], length), length - 1, kv_format)
        else:
            attended = attend(query, *kv.read(0, [0], length), length - 1)
        hd, heads = self.head_dim, self.num_heads
        gate = self.qkv[row, : 2 * heads * hd].reshape(heads, 2 * hd)[:, hd:]
        return (attended[0] * sigmoid(gate)).reshape(-1)


def run_case(case: CompressedCase, config: DecodeAttentionConfig) -> np.ndarray:
    """Write the whole cache with `kv_write`, then one decode step; the output [B, H * hd]."""
    caches = tuple(cuda.to_device(a) for a in case.empty_caches())
    rows = case.write_rows()
    if rows[0].shape[0]:
        k_rows, qkv, positions, table = (cuda.to_device(a) for a in rows)
        kv_write_launch(k_rows, qkv, positions, table, caches, case.format_name).run()
    batch = len(case.lengths)
    acc_shape, ml_shape = partial_buffer_shapes(batch, case.num_heads, case.head_dim, config)
    partials = cuda.device_array(acc_shape, np.float32), cuda.device_array(ml_shape, np.float32)
    out = cuda.to_device(np.full((batch, case.num_heads * case.head_dim), np.nan, np.float32))
    q, qkv, positions, table = (cuda.to_device(a) for a in (case.q, case.qkv, case.positions, case.page_table))
    launches = compressed_decode_attention(q, qkv, positions, table, caches, case.format_name, *partials, out, config)
    for launch in launches:
        launch.run()
    return out.copy_to_host()


def check_case(case: CompressedCase, config: DecodeAttentionConfig) -> None:
    out = run_case(case, config)
    for row, length in enumerate(case.lengths):
        if length == 0:
            np.testing.assert_array_equal(out[row], 0)
            continue
        for rotated in (True, False):
            expected = case.reference(row, rotated=rotated)
            bound = TOLERANCE * np.abs(expected).max()
            np.testing.assert_allclose(out[row], expected, rtol=0, atol=bound, err_msg=f"row {row} {rotated=}")


SMALL_TILES = DecodeAttentionConfig(num_splits=3, min_split_tokens=8, warps=1, unroll=4)  # hd 128: 8-token tiles


@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
def test_batch_of_different_lengths_with_several_splits(format_name: str) -> None:
    # Lengths 1, 0 (inactive), 21: one split, and three with a partial last tile, over pages of 8 tokens.
    check_case(CompressedCase(format_name, 4, 2, 128, [1, 0, 21], page_tokens=8), SMALL_TILES)


def test_real_head_size_and_group() -> None:
    # hd 256 (one row a warp), G = 4 as the 9B, tq3 keys and values: 2 splits, 2 warps of 2 tokens each.
    check_case(CompressedCase("tq3", 4, 1, 256, [13], page_tokens=4, seed=1), DecodeAttentionConfig(2, 4, 2, 2))


def test_very_negative_scores_keep_full_precision() -> None:
    # Every score near -100 or below: the softmax subtracts the real maximum, never a padding slot's 0.
    case = CompressedCase("tq3", 2, 1, 128, [11], page_tokens=8, seed=2)
    direction = case.q[0, 0] / np.linalg.norm(case.q[0, 0])
    case.q[0, 1] = case.q[0, 0]
    case.keys[0][:, 0] = -60 * direction + 0.1 * np.random.default_rng(3).standard_normal((11, 128))
    check_case(case, SMALL_TILES)


def test_launcher_rejects_bad_arguments() -> None:
    case = CompressedCase("tq3", 2, 1, 128, [5], page_tokens=8)
    acc_shape, ml_shape = partial_buffer_shapes(1, 2, 128, SMALL_TILES)
    partials = np.zeros(acc_shape, np.float32), np.zeros(ml_shape, np.float32)
    args = (case.q, case.qkv, case.positions, case.page_table, tuple(case.empty_caches()))
    out = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match="multiple of the 16-token attention tile"):
        compressed_decode_attention(*args, "tq3", *partials, out, DecodeAttentionConfig(3, 8, warps=1, unroll=8))
    with pytest.raises(ValueError, match="k_codes must be a 4-D int8"):
        compressed_decode_attention(*args, "q8", *partials, out, SMALL_TILES)
    with pytest.raises(ValueError, match="partial_acc must have shape"):
        compressed_decode_attention(*args, "tq3", *partials, out, DecodeAttentionConfig(4, 8, warps=1, unroll=4))
