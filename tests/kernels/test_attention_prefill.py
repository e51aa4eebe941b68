"""Prefill attention (`attention_prefill.py`) against a float64 numpy reference of causal GQA attention with
the sigmoid gate over the paged fp16 cache, and against `decode_attention` on the same inputs.

Simulator tests use tiny heads and the 2-warp simulator tiling; GPU tests (`-m gpu`) the 9B and 27B head
layouts (hd 256) with 256 rows at cache offsets 0, 3000 and 20000.

Tolerance: K/V are fp16 values (exact in fp32 and float64) and q is fp32, so the kernel's inputs are the
reference's; its error is fp32 rounding only: 256-term dot products (scores ~1e-6 relative), exp, and sums
of up to ~20k weights and weighted values, blocked over lanes, tiles and splits (typically ~1e-6, far below
1e-4 even for the long rows). Errors are measured against the row's largest output, as test_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.kernels.attention import DecodeAttentionConfig, decode_attention
from cmpchat.kernels.attention import partial_buffer_shapes as decode_buffer_shapes
from cmpchat.kernels.attention_prefill import (
    SIMULATOR_CONFIG,
    PrefillAttentionConfig,
    causal_fmas,
    partial_buffer_shapes,
    prefill_attention,
)
from cmpchat.kernels.device_table import default_tuning


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@dataclass
class PrefillCase:
    """R consecutive rows of one sequence from cache index `offset`, K/V of indices 0..offset+R-1 in a
    shuffled page pool (unwritten slots NaN); `inactive` rows get cache index -1."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rows: int
    offset: int
    page_tokens: int
    inactive: tuple[int, ...] = ()
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        hd, kv_heads = self.head_dim, self.num_kv_heads
        tokens = self.offset + self.rows
        pages_per_row = -(-tokens // self.page_tokens) + 1  # one spare page: capacity past the last row
        num_pages = pages_per_row + 2
        table = self.rng.permutation(num_pages)[:pages_per_row].astype(np.int32)
        self.page_table = np.tile(table, (self.rows, 1))
        self.cache_shape = (num_pages, self.page_tokens, kv_heads, hd)
        self.k_pool = np.full(self.cache_shape, np.nan, np.float16)
        self.v_pool = np.full(self.cache_shape, np.nan, np.float16)
        index = np.arange(tokens)
        pages, slots = table[index // self.page_tokens], index % self.page_tokens
        self.k_pool[pages, slots] = self.rng.standard_normal((tokens, kv_heads, hd)).astype(np.float16)
        self.v_pool[pages, slots] = self.rng.standard_normal((tokens, kv_heads, hd)).astype(np.float16)
        self.positions = np.zeros((self.rows, 4), np.int32)
        self.positions[:, 0] = self.offset + np.arange(self.rows)
        self.positions[:, 1:] = self.positions[:, :1]
        self.positions[list(self.inactive), 0] = -1
        self.q = (self.rng.standard_normal((self.rows, self.num_heads, hd)) * 1.5).astype(np.float32)
        width = 2 * (self.num_heads + kv_heads) * hd
        self.qkv = (self.rng.standard_normal((self.rows, width)) * 2).astype(np.float32)

    def reference(self) -> np.ndarray:
        return reference_attention(self.q, self.qkv, self.positions, self.page_table, self.k_pool, self.v_pool)


def reference_attention(q, qkv, positions, page_table, k_pool, v_pool) -> np.ndarray:
    """Causal GQA attention times sigmoid(gate) in float64 over the paged cache: row r attends to cache
    indices 0..positions[r, 0]; rows with an index outside the capacity give 0."""
    rows, num_heads, hd = q.shape
    page_tokens, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // num_kv_heads
    index = positions[:, 0].astype(np.int64)
    active = (index >= 0) & (index < page_table.shape[1] * page_tokens)
    out = np.zeros((rows, num_heads * hd))
    if not active.any():
        return out
    assert (page_table == page_table[0]).all(), "the reference gathers one sequence"
    keys = np.arange(index[active].max() + 1)
    pages, slots = page_table[0, keys // page_tokens], keys % page_tokens
    k = k_pool[pages, slots].astype(np.float64)  # [n, Hkv, hd]
    v = v_pool[pages, slots].astype(np.float64)
    visible = keys[None, :] <= np.where(active, index, 0)[:, None]  # [R, n]
    for head in range(num_heads):
        kv = head // group
        scores = q[:, head].astype(np.float64) @ k[:, kv].T / np.sqrt(hd)
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        gate = qkv[:, (2 * head + 1) * hd : (2 * head + 2) * hd].astype(np.float64)
        out[:, head * hd : (head + 1) * hd] = (weights @ v[:, kv]) * sigmoid(gate)
    out[~active] = 0
    return out


def run_prefill(case: PrefillCase, config: PrefillAttentionConfig) -> np.ndarray:
    q, qkv, positions, page_table = (cuda.to_device(a) for a in (case.q, case.qkv, case.positions, case.page_table))
    caches = cuda.to_device(case.k_pool), cuda.to_device(case.v_pool)
    acc_shape, ml_shape = partial_buffer_shapes(case.rows, case.num_heads, case.head_dim, config)
    partials = (
        cuda.to_device(np.full(acc_shape, np.nan, np.float32)),
        cuda.to_device(np.full(ml_shape, np.nan, np.float32)),
    )
    out = cuda.to_device(np.full((case.rows, case.num_heads * case.head_dim), np.nan, np.float32))
    for launch in prefill_attention(q, qkv, positions, page_table, *caches, *partials, out, config):
        launch.run()
    return out.copy_to_host()


def run_decode(case: PrefillCase, config: DecodeAttentionConfig) -> np.ndarray:
    q, qkv, positions, page_table = (cuda.to_device(a) for a in (case.q, case.qkv, case.positions, case.page_table))
    caches = cuda.to_device(case.k_pool), cuda.to_device(case.v_pool)
    acc_shape, ml_shape = decode_buffer_shapes(case.rows, case.num_heads, case.head_dim, config)
    partials = cuda.device_array(acc_shape, np.float32), cuda.device_array(ml_shape, np.float32)
    out = cuda.device_array((case.rows, case.num_heads * case.head_dim), np.float32)
    for launch in decode_attention(q, qkv, positions, page_table, *caches, *partials, out, config):
        launch.run()
    return out.copy_to_host()


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """Per row: |actual - expected| <= rtol * (|expected| + max |expected| of the row)."""
    assert np.isfinite(actual).all(), "NaN or inf in the output"
    for row in range(expected.shape[0]):
        scale = np.abs(expected[row]).max()
        np.testing.assert_allclose(actual[row], expected[row], rtol=rtol, atol=rtol * scale, err_msg=f"row {row}")


def check(case: PrefillCase, config: PrefillAttentionConfig, rtol: float = 1e-4) -> np.ndarray:
    out = run_prefill(case, config)
    assert_close(out, case.reference(), rtol)
    for row in case.inactive:
        np.testing.assert_array_equal(out[row], 0)
    return out


def sim_config(num_splits: int, **overrides) -> PrefillAttentionConfig:
    return PrefillAttentionConfig(num_splits=num_splits, **{**SIMULATOR_CONFIG, **overrides})


# --- simulator (tiny shapes) -----------------------------------------------------------------------------


def test_group_2_several_splits_two_pages_partial_last_query_tile():
    # G 2: 4 tokens per warp, 8-token query tiles; 20 rows = 2.5 tiles. Cache indices 76..95 over 32-slot
    # pages (3 pages of keys); 3 splits of 32 keys for the last tiles, 2 or 3 for the first.
    case = PrefillCase(num_heads=4, num_kv_heads=2, head_dim=32, rows=20, offset=76, page_tokens=32)
    check(case, sim_config(3))


def test_group_3_head_64_one_kv_head_with_inactive_rows():
    # G 3: 2 tokens per warp (6 rows), 4-token query tiles; rows 3 and 9 inactive (row 9 in the last,
    # partly filled tile; row 3 inside one).
    case = PrefillCase(
        num_heads=3, num_kv_heads=1, head_dim=64, rows=10, offset=37, page_tokens=32, inactive=(3, 9), seed=1
    )
    check(case, sim_config(2, pv_keys=16))


def test_from_an_empty_cache_with_one_split():
    # Offset 0: the diagonal tiles alone, every query tile's keys in one masked key tile.
    case = PrefillCase(num_heads=4, num_kv_heads=2, head_dim=32, rows=12, offset=0, page_tokens=32, seed=2)
    check(case, sim_config(1))


def test_all_rows_inactive_give_zeros():
    case = PrefillCase(num_heads=2, num_kv_heads=1, head_dim=32, rows=4, offset=3, page_tokens=32,
                       inactive=(0, 1, 2, 3), seed=3)  # fmt: skip
    check(case, sim_config(2))


def test_matches_decode_attention_in_the_simulator():
    case = PrefillCase(num_heads=4, num_kv_heads=2, head_dim=32, rows=9, offset=40, page_tokens=32, seed=4)
    prefill = check(case, sim_config(2))
    decode = run_decode(case, DecodeAttentionConfig(num_splits=2, min_split_tokens=16, warps=2, unroll=1))
    assert_close(prefill, decode.astype(np.float64), 2e-5)


def test_launcher_rejects_bad_arguments():
    case = PrefillCase(num_heads=4, num_kv_heads=2, head_dim=32, rows=4, offset=3, page_tokens=32)
    config = sim_config(2)
    acc_shape, ml_shape = partial_buffer_shapes(4, 4, 32, config)
    args = [case.q, case.qkv, case.positions, case.page_table, case.k_pool, case.v_pool,
            np.zeros(acc_shape, np.float32), np.zeros(ml_shape, np.float32), np.zeros((4, 128), np.float32)]  # fmt: skip

    def rejects(
        message: str, index: int | None = None, value: np.ndarray | None = None, cfg: PrefillAttentionConfig = config
    ) -> None:
        changed = list(args)
        if index is not None:
            assert value is not None
            changed[index] = value
        q, qkv, positions, page_table, k_cache, v_cache, acc, ml, out = changed
        with pytest.raises(ValueError, match=message):
            prefill_attention(q, qkv, positions, page_table, k_cache, v_cache, acc, ml, out, cfg)

    rejects("q must be a 3-D float32", 0, case.q.astype(np.float64))
    rejects("positions must have shape", 2, case.positions[:, :3].copy())
    rejects("positions must be a 2-D int32", 2, case.positions.astype(np.int64))
    rejects("page_table has 3 rows", 3, case.page_table[:3].copy())
    rejects("k_cache must be a 4-D float16", 4, case.k_pool.astype(np.float32))
    rejects("v_cache must have shape", 5, case.v_pool[:1].copy())
    rejects("qkv must have shape", 1, case.qkv[:, :-1].copy())
    rejects("partial_acc must have shape", cfg=sim_config(3))
    rejects("out must be a 2-D float32", 8, np.zeros((4, 128), np.float16))
    rejects("multiple of the 64-key", cfg=sim_config(2, key_lanes=2))
    rejects("need a group of 1..8", 0, np.zeros((4, 3, 32), np.float32))
    with pytest.raises(ValueError, match="num_splits"):
        PrefillAttentionConfig(num_splits=0)
    with pytest.raises(ValueError, match="invalid prefill attention config"):
        PrefillAttentionConfig(num_splits=1, pv_keys=6)


def test_splits_fill_the_gpu_and_defaults_fit_shared_memory():
    nine, twenty_seven = (PrefillAttentionConfig.splits_for(256, h, 4, 68) for h in (16, 24))
    assert nine.query_tokens(4) == 16 and twenty_seven.query_tokens(6) == 8
    # blocks = query tiles x Hkv x splits >= 68 SMs x resident blocks x 4 waves
    for config, tiles in ((nine, 16), (twenty_seven, 32)):
        assert tiles * 4 * config.num_splits >= 68 * config.blocks_per_sm * 4
        assert tiles * 4 * (config.num_splits - 1) < 68 * config.blocks_per_sm * 4
    assert PrefillAttentionConfig.splits_for(256, 16, 4, 100_000).num_splits == 1024
    for group in (4, 6):
        assert PrefillAttentionConfig(1).shared_bytes(group, 256) <= 48 * 1024


def test_causal_fma_count():
    # rows at indices 0, 1 and an inactive one: (1 + 2) keys x 2 heads x 8 dims x 2 products
    assert causal_fmas(np.array([0, 1, -1]), 2, 8) == 96


# --- GPU (real shapes) -----------------------------------------------------------------------------------

GPU_SHAPES = {"9B": (16, 4), "27B": (24, 4)}


def gpu_config(num_heads: int, num_kv_heads: int, rows: int) -> PrefillAttentionConfig:
    gpu = gpu_info(0)
    return default_tuning(gpu).prefill_attention_config(rows, num_heads, num_kv_heads, gpu.multiprocessors)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 3000, 20000])
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_real_shapes_against_float64_on_gpu(model, offset):
    heads, kv_heads = GPU_SHAPES[model]
    inactive = (250, 255) if offset == 3000 else ()  # a step whose prompt tail ends before the last rows
    case = PrefillCase(heads, kv_heads, 256, 256, offset, page_tokens=1024, inactive=inactive, seed=offset)
    check(case, gpu_config(heads, kv_heads, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_one_split_and_many_splits_on_gpu(model):
    heads, kv_heads = GPU_SHAPES[model]
    case = PrefillCase(heads, kv_heads, 256, 256, 1234, page_tokens=64, seed=7)  # 64-slot pages: many pages
    for splits in (1, 37):
        check(case, PrefillAttentionConfig(num_splits=splits, min_split_tokens=64))


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(GPU_SHAPES))
def test_matches_decode_attention_on_gpu(model):
    heads, kv_heads = GPU_SHAPES[model]
    case = PrefillCase(heads, kv_heads, 256, 256, 5000, page_tokens=256, seed=8)
    prefill = run_prefill(case, gpu_config(heads, kv_heads, 256))
    gpu = gpu_info(0)
    decode = run_decode(case, default_tuning(gpu).decode_attention_config(256, heads, kv_heads, gpu.multiprocessors))
    assert_close(prefill, decode.astype(np.float64), 2e-5)


@pytest.mark.gpu
def test_benchmark_reports_fma_rate():
    from cmpchat.bench.kernels.attention_prefill import benchmark_prefill_attention

    result = benchmark_prefill_attention(num_heads=16, num_kv_heads=4, context=4096, repeats=3)
    assert result["fma_rate"] > 0
    print(result)
