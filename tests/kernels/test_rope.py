"""q/k RMSNorm + IMROPE + KV-cache write (`qk_norm_rope`) against the reference's rms_norm / rope_angles /
apply_rope: under the simulator at tiny shapes, on a GPU (`-m gpu`) at the 9B and 27B head shapes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from numba import cuda
from numpy.typing import ArrayLike

from cmpchat.backends.reference.layers import apply_rope, rms_norm, rope_angles
from cmpchat.kernels.qk_norm_rope import qk_norm_rope_launch, rope_tables

EPS = 1e-6
THETA = 1e7


@dataclass
class RopeCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dims: int
    sections: tuple[int, ...]
    qkv: np.ndarray  # [B, 2*H*hd + 2*Hkv*hd]
    positions: np.ndarray  # [B, 4] (cache_index, t, h, w)
    page_table: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    cache_shape: tuple[int, ...]


def make_case(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_dims: int,
    sections: tuple[int, ...],
    positions: ArrayLike,
    page_tokens: int,
    seed: int = 0,
) -> RopeCase:
    rng = np.random.default_rng(seed)
    positions = np.asarray(positions, dtype=np.int32)
    batch = positions.shape[0]
    # Only the page holding each row's new token is touched: give those distinct pages of a small pool and
    # point the rest of the table anywhere (a 256K-token table must not need a 256K-token pool).
    pages_per_row = -(-(int(positions[:, 0].max()) + 1) // page_tokens)
    num_pages = batch + 3
    page_table = rng.integers(0, num_pages, (batch, pages_per_row)).astype(np.int32)
    new_pages = rng.permutation(num_pages)[:batch]
    for row, cache_index in enumerate(positions[:, 0]):
        page_table[row, max(cache_index, 0) // page_tokens] = new_pages[row]
    width = 2 * (num_heads + num_kv_heads) * head_dim
    return RopeCase(
        num_heads,
        num_kv_heads,
        head_dim,
        rope_dims,
        sections,
        qkv=(rng.standard_normal((batch, width)) * 3).astype(np.float32),
        positions=positions,
        page_table=page_table,
        q_norm=rng.uniform(0.5, 1.5, head_dim).astype(np.float32),
        k_norm=rng.uniform(0.5, 1.5, head_dim).astype(np.float32),
        cache_shape=(num_pages, page_tokens, num_kv_heads, head_dim),
    )


def run_case(case: RopeCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, K cache, V cache after one launch; the caches start as NaN so untouched slots show."""
    tables = rope_tables(case.rope_dims, THETA, case.sections)
    batch = case.qkv.shape[0]
    q = cuda.to_device(np.full((batch, case.num_heads, case.head_dim), np.nan, np.float32))
    k_cache = cuda.to_device(np.full(case.cache_shape, np.nan, np.float16))
    v_cache = cuda.to_device(np.full(case.cache_shape, np.nan, np.float16))
    host = (case.qkv, case.positions, case.page_table, case.q_norm, case.k_norm, tables.inv_freq, tables.freq_axis)
    qkv, positions, page_table, q_norm, k_norm, inv_freq, freq_axis = (cuda.to_device(a) for a in host)
    launch = qk_norm_rope_launch(
        qkv, positions, page_table, q_norm, k_norm, inv_freq, freq_axis, EPS, q, k_cache, v_cache
    )
    launch.run()
    return q.copy_to_host(), k_cache.copy_to_host(), v_cache.copy_to_host()


def reference_row(case: RopeCase, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normed, rotated q [H, hd] and k [Hkv, hd], and v [Hkv, hd], as GatedAttention computes them."""
    h, hkv, hd = case.num_heads, case.num_kv_heads, case.head_dim
    x = case.qkv[row]
    query = x[: 2 * h * hd].reshape(1, h, 2 * hd)[..., :hd]
    key = x[2 * h * hd : (2 * h + hkv) * hd].reshape(1, hkv, hd)
    value = x[(2 * h + hkv) * hd :].reshape(hkv, hd)
    angles = rope_angles(case.positions[row : row + 1, 1:].astype(np.int64), case.rope_dims, THETA, case.sections)
    query = apply_rope(rms_norm(query, case.q_norm, EPS), angles)[0]
    key = apply_rope(rms_norm(key, case.k_norm, EPS), angles)[0]
    return query, key, value


def assert_fp16_close(actual: np.ndarray, expected_fp32: np.ndarray) -> None:
    """Stored fp16 equals astype(float16) of the reference, or is its neighbour where fp32 rounding differs."""
    expected = expected_fp32.astype(np.float16)
    ulps = np.abs(actual.view(np.int16).astype(np.int32) - expected.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1, f"fp16 K differs by {ulps.max()} ulps"
    assert np.mean(ulps == 0) > 0.99


def check_against_reference(
    case: RopeCase, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, q_tol: float
) -> None:
    page_tokens = case.cache_shape[1]
    written = np.zeros(case.cache_shape[:3], dtype=bool)
    for row, (cache_index, *_) in enumerate(case.positions):
        if cache_index < 0:
            assert np.isnan(q[row]).all()
            continue
        query, key, value = reference_row(case, row)
        np.testing.assert_allclose(q[row], query, rtol=q_tol, atol=q_tol)
        page, slot = case.page_table[row, cache_index // page_tokens], cache_index % page_tokens
        assert_fp16_close(k_cache[page, slot], key)
        np.testing.assert_array_equal(v_cache[page, slot], value.astype(np.float16))
        written[page, slot] = True
    assert np.isnan(k_cache[~written]).all() and np.isnan(v_cache[~written]).all(), "wrote outside the new slots"


def test_rope_tables_give_the_reference_angles() -> None:
    sections = (11, 11, 10, 0)
    tables = rope_tables(64, THETA, sections)
    positions = np.array([[0, 0, 0], [7, 3, 5], [262143, 17, 250000], [99, 99, 99]])
    chosen = positions[:, tables.freq_axis].astype(np.float64)
    angles = (chosen * tables.inv_freq).astype(np.float32)
    np.testing.assert_array_equal(angles, rope_angles(positions, 64, THETA, sections))
    assert list(tables.freq_axis[:9]) == [0, 1, 2] * 3 and list(tables.freq_axis[29:]) == [2, 0, 1]


def test_tiny_batch_with_multimodal_positions_and_an_inactive_row() -> None:
    positions = [
        [0, 0, 0, 0],  # first token
        [37, 40, 12, 29],  # an image token: t, h, w all different, none equal to the cache index
        [-1, 5, 5, 5],  # inactive row: no write
        [150, 200000, 200000, 200000],  # text far out: large angles
    ]
    case = make_case(4, 2, 32, 16, (3, 3, 2, 0), positions, page_tokens=16)
    check_against_reference(case, *run_case(case), q_tol=1e-5)


def test_rope_on_part_of_a_real_size_head() -> None:
    case = make_case(2, 1, 256, 64, (11, 11, 10, 0), [[5, 9, 3, 7], [300, 300, 300, 300]], page_tokens=64, seed=1)
    check_against_reference(case, *run_case(case), q_tol=1e-5)


def test_launcher_rejects_bad_arguments() -> None:
    case = make_case(4, 2, 32, 16, (3, 3, 2, 0), [[3, 3, 3, 3]], page_tokens=16)
    tables = rope_tables(16, THETA, case.sections)
    q = np.zeros((1, 4, 32), np.float32)
    cache = np.zeros(case.cache_shape, np.float16)
    args = (case.qkv, case.positions, case.page_table, case.q_norm, case.k_norm, tables.inv_freq, tables.freq_axis)
    with pytest.raises(ValueError, match="qkv must have shape"):
        qk_norm_rope_launch(case.qkv[:, :-32].copy(), *args[1:], EPS, q, cache, cache)
    with pytest.raises(ValueError, match="k_cache must be a 4-D float16"):
        qk_norm_rope_launch(*args, EPS, q, cache.astype(np.float32), cache)
    with pytest.raises(ValueError, match="decode_positions must have shape"):
        qk_norm_rope_launch(args[0], case.positions[:, :3].copy(), *args[2:], EPS, q, cache, cache)
    with pytest.raises(ValueError, match="inv_freq must be a 1-D float64"):
        qk_norm_rope_launch(*args[:5], tables.inv_freq.astype(np.float32), tables.freq_axis, EPS, q, cache, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 24], ids=["9B", "27B"])
def test_real_head_shapes_on_gpu(num_heads: int) -> None:
    rng = np.random.default_rng(2)
    rows = 16
    cache_index = rng.integers(0, 262144, rows)
    thw = rng.integers(0, 262144, (rows, 3))
    thw[:8] = cache_index[:8, None]  # half text, half image-like positions
    positions = np.concatenate([cache_index[:, None], thw], axis=1)
    case = make_case(num_heads, 4, 256, 64, (11, 11, 10, 0), positions, page_tokens=4096, seed=3)
    check_against_reference(case, *run_case(case), q_tol=2e-5)
