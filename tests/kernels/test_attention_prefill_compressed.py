"""Prefill attention over a compressed cache (`attention_prefill.compressed_prefill_attention`) under the
simulator: a cache written by the GPU's `kv_write`, attended by the prefill kernels, against the reference's
cache in the same format (`PagedKv`, encoded by `kv_formats`) attended in the rotated domain
(`attend_rotated`) and decoded first (`attend`), with the sigmoid gate.

The two sides hold the same codes (test_kv_write.py), so they differ only in fp32 summation order: within 1e-4
of the row's largest output, as test_attention_compressed.py. Tiny heads (hd 128, tq3's block) and the 2-warp
simulator tiling; the GPU tests (test_attention_prefill_compressed_gpu.py) the 9B shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.reference.attention import PagedKv, attend, attend_rotated
from cmpchat.backends.reference.layers import sigmoid
from cmpchat.kernels.attention_prefill import (
    PrefillAttentionConfig,
    compressed_prefill_attention,
    partial_buffer_shapes,
)
from cmpchat.kernels.kv_codes import GPU_FORMATS
from cmpchat.kernels.kv_write import kv_write_launch
from cmpchat.kv_formats import FORMATS
from tests.kernels.test_attention import attention_config
from tests.kernels.test_attention_prefill import sim_config

TOLERANCE = 1e-4


@dataclass
class CompressedPrefillCase:
    """R consecutive rows of one sequence from cache index `offset` over shuffled pages; `inactive` rows get
    cache index -1 (their keys and values are still in the cache, as the step writes every row's first)."""

    format_name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rows: int
    offset: int
    page_tokens: int
    inactive: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        hkv, hd, tokens = self.num_kv_heads, self.head_dim, self.offset + self.rows
        pages_per_row = -(-tokens // self.page_tokens) + 1  # one spare page: capacity past the last row
        self.num_pages = pages_per_row + 2
        table = rng.permutation(self.num_pages)[:pages_per_row].astype(np.int32)
        self.page_table = np.tile(table, (self.rows, 1))
        self.keys = (rng.standard_normal((tokens, hkv, hd)) * 1.5).astype(np.float32)
        self.values = rng.standard_normal((tokens, hkv, hd)).astype(np.float32)
        self.q = (rng.standard_normal((self.rows, self.num_heads, hd)) * 1.5).astype(np.float32)
        width = 2 * (self.num_heads + hkv) * hd
        self.qkv = (rng.standard_normal((self.rows, width)) * 2).astype(np.float32)
        self.positions = np.zeros((self.rows, 4), np.int32)
        self.positions[:, 0] = self.offset + np.arange(self.rows)
        self.positions[list(self.inactive), 0] = -1

    def write_rows(self) -> tuple[np.ndarray, ...]:
        """Every token as one row of a `kv_write` launch: k_rows, qkv (the values in its last columns),
        positions, page table."""
        tokens = self.offset + self.rows
        qkv = np.zeros((tokens, self.qkv.shape[1]), np.float32)
        qkv[:, -self.num_kv_heads * self.head_dim :] = self.values.reshape(tokens, -1)
        positions = np.zeros((tokens, 4), np.int32)
        positions[:, 0] = np.arange(tokens)
        return self.keys, qkv, positions, np.tile(self.page_table[0], (tokens, 1))

    def empty_caches(self) -> list[np.ndarray]:
        lead = (self.num_pages, self.page_tokens, self.num_kv_heads)
        arrays: list[np.ndarray] = []
        for codec in GPU_FORMATS[self.format_name]:
            arrays += [np.full((*lead, codec.codes_per_vector(self.head_dim)), 0x5A, codec.code_dtype),
                       np.zeros((*lead, codec.scales_per_vector(self.head_dim)), codec.scale_dtype)]  # fmt: skip
        return arrays

    def reference(self, *, rotated: bool) -> np.ndarray:
        """The reference's gated attention output [R, H * hd] over its cache in the format."""
        config = attention_config(self.num_heads, self.num_kv_heads, self.head_dim, 32, (6, 5, 5, 0))
        tokens = self.offset + self.rows
        kv_format = FORMATS[self.format_name]
        kv = PagedKv(config, tokens, kv_format, rotated_attention=rotated)
        kv.write(0, [0], 0, self.keys, self.values)
        if rotated:
            attended = attend_rotated(self.q, *kv.read_rotated(0, [0], tokens), self.offset, kv_format)
        else:
            attended = attend(self.q, *kv.read(0, [0], tokens), self.offset)
        hd, heads = self.head_dim, self.num_heads
        gate = self.qkv[:, : 2 * heads * hd].reshape(self.rows, heads, 2 * hd)[:, :, hd:]
        return (attended * sigmoid(gate)).reshape(self.rows, -1)


def run_case(case: CompressedPrefillCase, config: PrefillAttentionConfig) -> np.ndarray:
    """Write the whole cache with `kv_write`, then one prefill-attention step; the output [R, H * hd]."""
    caches = tuple(cuda.to_device(a) for a in case.empty_caches())
    k_rows, qkv, positions, table = (cuda.to_device(a) for a in case.write_rows())
    kv_write_launch(k_rows, qkv, positions, table, caches, case.format_name).run()
    acc_shape, ml_shape = partial_buffer_shapes(case.rows, case.num_heads, case.head_dim, config)
    partials = (
        cuda.to_device(np.full(acc_shape, np.nan, np.float32)),
        cuda.to_device(np.full(ml_shape, np.nan, np.float32)),
    )
    out = cuda.to_device(np.full((case.rows, case.num_heads * case.head_dim), np.nan, np.float32))
    q, qkv, positions, table = (cuda.to_device(a) for a in (case.q, case.qkv, case.positions, case.page_table))
    launches = compressed_prefill_attention(q, qkv, positions, table, caches, case.format_name, *partials, out, config)
    for launch in launches:
        launch.run()
    return out.copy_to_host()


def check_case(case: CompressedPrefillCase, config: PrefillAttentionConfig) -> None:
    out = run_case(case, config)
    assert np.isfinite(out).all(), "NaN or inf in the output"
    expected = {rotated: case.reference(rotated=rotated) for rotated in (True, False)}
    for row in range(case.rows):
        if row in case.inactive:
            np.testing.assert_array_equal(out[row], 0)
            continue
        for rotated, reference in expected.items():
            bound = TOLERANCE * np.abs(reference[row]).max()
            np.testing.assert_allclose(out[row], reference[row], rtol=0, atol=bound, err_msg=f"row {row} {rotated=}")


@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
def test_each_format_over_two_splits_and_pages_with_an_inactive_row(format_name: str) -> None:
    # G 2: 8-token query tiles, 10 rows = 1.25 tiles; cache indices 30..39 over 32-slot pages (2 pages of keys,
    # the last tile's keys past the split's end unwritten); 2 splits of 32 keys; row 4 inactive.
    case = CompressedPrefillCase(format_name, 4, 2, 128, rows=10, offset=30, page_tokens=32, inactive=(4,))
    check_case(case, sim_config(2))


def test_tq3_from_an_empty_cache_with_one_split() -> None:
    # Offset 0: the diagonal tiles alone; G 1, 8 rows a warp.
    check_case(CompressedPrefillCase("tq3", 1, 1, 128, rows=9, offset=0, page_tokens=32, seed=1), sim_config(1))


def test_launcher_rejects_bad_arguments() -> None:
    case = CompressedPrefillCase("tq3", 2, 1, 128, rows=4, offset=3, page_tokens=32)
    config = sim_config(2)
    acc_shape, ml_shape = partial_buffer_shapes(4, 2, 128, config)
    partials = np.zeros(acc_shape, np.float32), np.zeros(ml_shape, np.float32)
    args = (case.q, case.qkv, case.positions, case.page_table, tuple(case.empty_caches()))
    out = np.zeros((4, 256), np.float32)
    with pytest.raises(ValueError, match="k_codes must be a 4-D int8"):
        compressed_prefill_attention(*args, "q8", *partials, out, config)
    with pytest.raises(ValueError, match="no GPU kernels for the KV format 'naive3'"):
        compressed_prefill_attention(*args, "naive3", *partials, out, config)
    with pytest.raises(ValueError, match="multiple of the 64-key prefill attention tile"):
        compressed_prefill_attention(*args, "tq3", *partials, out, sim_config(2, key_lanes=2))
