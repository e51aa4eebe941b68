"""One decode step of gated attention on the device (qk_norm_rope, then split-K attention and the combine)
against the reference `GatedAttention` in GPU-mirroring mode (fp16 KV cache).

Simulator tests use tiny heads (and one real-size head); GPU tests (`-m gpu`) the 9B and 27B head shapes
with contexts of 1, 1000 and 32768 tokens in one batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.backends.reference.attention import GatedAttention, PagedKv
from cmpchat.backends.reference.layers import Linear, apply_rope, rms_norm, rope_angles
from cmpchat.kernels.attention import DecodeAttentionConfig, decode_attention, partial_buffer_shapes
from cmpchat.kernels.device_table import SM_70, SM_90, default_tuning
from cmpchat.kernels.qk_norm_rope import qk_norm_rope_launch, rope_tables
from cmpchat.kv_formats import F16
from cmpchat.model.config import LayerKind, ModelConfig

EPS = 1e-6


def attention_config(
    num_heads: int, num_kv_heads: int, head_dim: int, rope_dims: int, sections: tuple[int, int, int, int]
) -> ModelConfig:
    """A ModelConfig with just the attention sizes that matter here."""
    return ModelConfig(
        name="attention-test",
        vocab_size=256,
        hidden_size=64,
        ffn_size=64,
        context_length=1 << 18,
        rms_eps=EPS,
        layer_kinds=(LayerKind.ATTENTION,),
        num_mtp_layers=0,
        tied_embeddings=True,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_dims=rope_dims,
        rope_theta=1e7,
        rope_sections=sections,
        conv_kernel=4,
        num_k_heads=1,
        num_v_heads=1,
        k_head_dim=32,
        v_head_dim=32,
    )


class Projection(Linear):
    """Stands in for a weight matrix of the reference layer: its output is `function` of the input."""

    def __init__(self, function: Callable[[np.ndarray], np.ndarray]) -> None:  # no weights to load
        self.function = function

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.function(x)


@dataclass
class DecodeCase:
    """A batch of rows, each with its own cached history (fp16) and new token, stored in a shuffled page pool."""

    config: ModelConfig
    history: list[int]  # cached tokens per row before the step; -1 = inactive row
    page_tokens: int
    seed: int = 0
    thw: np.ndarray | None = None  # [B, 3] rope positions; default: text, = history
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.rng = np.random.default_rng(self.seed)
        batch, hd = len(self.history), cfg.head_dim
        lengths = [max(n, 0) + 1 for n in self.history]
        pages_per_row = max(-(-n // self.page_tokens) for n in lengths)
        num_pages = batch * pages_per_row + 2
        self.page_table = self.rng.permutation(num_pages)[: batch * pages_per_row].astype(np.int32)
        self.page_table = self.page_table.reshape(batch, pages_per_row)
        self.cache_shape = (num_pages, self.page_tokens, cfg.num_kv_heads, hd)
        self.k_pool = np.full(self.cache_shape, np.nan, np.float16)
        self.v_pool = np.full(self.cache_shape, np.nan, np.float16)
        self.caches = []
        for row, n in enumerate(self.history):
            keys = self.rng.standard_normal((max(n, 0), cfg.num_kv_heads, hd)).astype(np.float16)
            values = self.rng.standard_normal((max(n, 0), cfg.num_kv_heads, hd)).astype(np.float16)
            for token in range(max(n, 0)):
                page, slot = self.slot(row, token)
                self.k_pool[page, slot], self.v_pool[page, slot] = keys[token], values[token]
            self.caches.append((keys, values))
        if self.thw is None:
            self.thw = np.repeat(np.maximum(self.history, 0)[:, None], 3, axis=1)
        self.positions = np.concatenate([np.array(self.history)[:, None], self.thw], axis=1).astype(np.int32)
        width = 2 * (cfg.num_heads + cfg.num_kv_heads) * hd
        self.qkv = (self.rng.standard_normal((batch, width)) * 2).astype(np.float32)
        self.q_norm = self.rng.uniform(0.5, 1.5, hd).astype(np.float32)
        self.k_norm = self.rng.uniform(0.5, 1.5, hd).astype(np.float32)

    def slot(self, row: int, token: int) -> tuple[int, int]:
        return int(self.page_table[row, token // self.page_tokens]), token % self.page_tokens

    def reference(self, row: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """The reference layer's output (before attn_output) and its cached keys and values after the step."""
        cfg, hd, heads = self.config, self.config.head_dim, self.config.num_heads
        layer = object.__new__(GatedAttention)  # its projections replaced by this row's fused output
        layer.config, layer.q_norm, layer.k_norm = cfg, self.q_norm, self.k_norm
        x = self.qkv[row : row + 1]
        layer.q = Projection(lambda _: x[:, : 2 * heads * hd])
        layer.k = Projection(lambda _: x[:, 2 * heads * hd : (2 * heads + cfg.num_kv_heads) * hd])
        layer.v = Projection(lambda _: x[:, (2 * heads + cfg.num_kv_heads) * hd :])
        layer.out = Projection(lambda attended: attended)
        keys, values = self.caches[row]
        past = keys.shape[0]
        kv = PagedKv(cfg, past + 1, F16)  # the row's history in one page of the reference's own store
        kv.write(0, [0], 0, keys, values)
        assert self.thw is not None  # filled in by __post_init__
        out = layer(np.zeros((1, 1), np.float32), kv, 0, [0], past, self.thw[row : row + 1].astype(np.int64))
        return out[0], kv.read(0, [0], past + 1)


def run_step(case: DecodeCase, attention: DecodeAttentionConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Launch the three kernels of one step; output [B, H*hd] and the two caches."""
    cfg, batch = case.config, len(case.history)
    tables = rope_tables(cfg.rope_dims, cfg.rope_theta, cfg.rope_sections)
    qkv, positions, page_table = (cuda.to_device(a) for a in (case.qkv, case.positions, case.page_table))
    k_cache, v_cache = cuda.to_device(case.k_pool), cuda.to_device(case.v_pool)
    q = cuda.device_array((batch, cfg.num_heads, cfg.head_dim), np.float32)
    acc_shape, ml_shape = partial_buffer_shapes(batch, cfg.num_heads, cfg.head_dim, attention)
    partials = cuda.device_array(acc_shape, np.float32), cuda.device_array(ml_shape, np.float32)
    out = cuda.to_device(np.full((batch, cfg.num_heads * cfg.head_dim), np.nan, np.float32))
    rope_inputs = (case.q_norm, case.k_norm, tables.inv_freq, tables.freq_axis)
    q_norm, k_norm, inv_freq, freq_axis = (cuda.to_device(a) for a in rope_inputs)
    rope = qk_norm_rope_launch(
        qkv, positions, page_table, q_norm, k_norm, inv_freq, freq_axis, EPS, q, k_cache, v_cache
    )
    attend = decode_attention(q, qkv, positions, page_table, k_cache, v_cache, *partials, out, attention)
    for launch in (rope, *attend):
        launch.run()
    return out.copy_to_host(), k_cache.copy_to_host(), v_cache.copy_to_host()


def check_step(case: DecodeCase, attention: DecodeAttentionConfig, rtol: float = 1e-4) -> None:
    out, k_cache, v_cache = run_step(case, attention)
    untouched = np.ones(case.cache_shape[:2], bool)
    for row, n in enumerate(case.history):
        if n < 0:
            np.testing.assert_array_equal(out[row], 0)
            continue
        expected, cache = case.reference(row)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(out[row], expected, rtol=rtol, atol=rtol * scale, err_msg=f"row {row}")
        page, slot = case.slot(row, n)
        untouched[page, slot] = False
        ulps = np.abs(
            k_cache[page, slot].view(np.int16).astype(np.int32) - cache[0][-1].astype(np.float16).view(np.int16)
        )
        assert ulps.max() <= 1, f"row {row}: cached K off by {ulps.max()} fp16 ulps"
        np.testing.assert_array_equal(v_cache[page, slot], cache[1][-1].astype(np.float16))
    # History and free slots (NaN) unchanged: the step wrote only the new tokens' slots.
    np.testing.assert_array_equal(k_cache[untouched], case.k_pool[untouched])
    np.testing.assert_array_equal(v_cache[untouched], case.v_pool[untouched])


TINY = attention_config(4, 2, 32, 16, (3, 3, 2, 0))
SMALL_TILES = DecodeAttentionConfig(num_splits=4, min_split_tokens=16, warps=2, unroll=1)  # 16-token tiles


def test_batch_of_different_lengths_with_several_splits() -> None:
    # Lengths 1, 38, 151: one split, three, four with a partial last tile; t != h != w for row 1.
    thw = np.array([[0, 0, 0], [40, 12, 29], [150, 150, 150]])
    check_step(DecodeCase(TINY, [0, 37, 150], page_tokens=16, thw=thw), SMALL_TILES)


def test_inactive_rows_are_skipped() -> None:
    check_step(DecodeCase(TINY, [20, -1, 5], page_tokens=16, seed=1), SMALL_TILES)


def test_very_negative_scores_keep_full_precision() -> None:
    # All scores near -100 or below (exp underflows past -87): the softmax must subtract the real maximum,
    # never the 0 score of a padding slot in the partial last tile.
    case = DecodeCase(TINY, [37], page_tokens=16, seed=6)
    heads, hd = TINY.num_heads, TINY.head_dim
    case.q_norm[:], case.k_norm[:] = 5, 5
    query = case.qkv[0, : 2 * heads * hd].reshape(heads, 2 * hd)[:, :hd]
    query[1::2] = query[::2]  # both heads of a group alike
    case.qkv[0, 2 * heads * hd : (2 * heads + 2) * hd] = -query[::2].ravel()  # new key opposes the query
    assert case.thw is not None
    angles = rope_angles(case.thw[:1], TINY.rope_dims, TINY.rope_theta, TINY.rope_sections)
    rotated = apply_rope(rms_norm(query[None, ::2], case.q_norm, EPS), angles)[0]  # [Hkv, hd]
    direction = rotated / np.linalg.norm(rotated, axis=-1, keepdims=True)
    keys = -20 * direction + 0.1 * case.rng.standard_normal((37, 2, hd))
    case.caches[0] = (keys.astype(np.float16), case.caches[0][1])
    for token in range(37):
        case.k_pool[case.slot(0, token)] = case.caches[0][0][token]
    check_step(case, SMALL_TILES)


@pytest.mark.parametrize("splits", [1, 3])
def test_default_tiling_one_page_per_row(splits: int) -> None:
    # warps=4, unroll=4: 128-token tiles; one page per row is the plain per-slot cache layout.
    check_step(DecodeCase(TINY, [140, 3], page_tokens=256, seed=2), DecodeAttentionConfig(splits, 128))


def test_real_head_size() -> None:
    cfg = attention_config(2, 1, 256, 64, (11, 11, 10, 0))
    check_step(DecodeCase(cfg, [17, 3], page_tokens=8, seed=3), DecodeAttentionConfig(3, 8, warps=1, unroll=2))


def test_launcher_rejects_bad_arguments() -> None:
    case = DecodeCase(TINY, [5], page_tokens=8)
    q = np.zeros((1, 4, 32), np.float32)
    acc_shape, ml_shape = partial_buffer_shapes(1, 4, 32, SMALL_TILES)
    args = (
        q,
        case.qkv,
        case.positions,
        case.page_table,
        case.k_pool,
        case.v_pool,
        np.zeros(acc_shape, np.float32),
        np.zeros(ml_shape, np.float32),
        np.zeros((1, 128), np.float32),
    )
    with pytest.raises(ValueError, match="multiple of the 16-token attention tile"):
        decode_attention(*args, SMALL_TILES)
    with pytest.raises(ValueError, match="partial_acc must have shape"):
        decode_attention(*args, DecodeAttentionConfig(8, 16, warps=1, unroll=1))
    with pytest.raises(ValueError, match="out must be a 2-D float32"):
        decode_attention(*args[:-1], np.zeros((1, 128), np.float16), DecodeAttentionConfig(4, 8, 1, 1))
    with pytest.raises(ValueError, match="num_splits"):
        DecodeAttentionConfig(0)


def test_splits_fill_the_gpu() -> None:
    assert SM_70.decode_attention_config(1, 16, 4, 68).num_splits == 68  # 4 blocks per SM at G=4
    assert SM_90.decode_attention_config(1, 24, 4, 132).num_splits == 66  # 2 at G=6
    assert SM_90.decode_attention_config(1, 12, 4, 132).num_splits == 132  # other G: 4
    assert DecodeAttentionConfig.splits_for(16, 4, 132, blocks_per_sm=8).num_splits == 17
    assert SM_90.decode_attention_config(1, 4, 1, 100_000).num_splits == 1024
    assert SM_90.decode_attention_config(1, 16, 4, 132) == DecodeAttentionConfig(132, 32, warps=4, unroll=4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 24], ids=["9B", "27B"])
def test_contexts_1_1000_32768_on_gpu(num_heads: int) -> None:
    cfg = attention_config(num_heads, 4, 256, 64, (11, 11, 10, 0))
    thw = np.array([[0, 0, 0], [1200, 37, 55], [32767, 32767, 32767]])  # row 1 is an image token
    case = DecodeCase(cfg, [0, 999, 32767], page_tokens=256, seed=4, thw=thw)
    gpu = gpu_info(0)
    check_step(case, default_tuning(gpu).decode_attention_config(3, num_heads, 4, gpu.multiprocessors))


@pytest.mark.gpu
def test_full_batch_per_slot_layout_on_gpu() -> None:
    # 16 rows of random lengths, each row one slot of a contiguous [16, 4096, Hkv, hd] cache.
    cfg = attention_config(24, 4, 256, 64, (11, 11, 10, 0))
    history = list(np.random.default_rng(5).integers(0, 4095, 16))
    history[3] = -1
    case = DecodeCase(cfg, history, page_tokens=4096, seed=5)
    gpu = gpu_info(0)
    check_step(case, default_tuning(gpu).decode_attention_config(16, 24, 4, gpu.multiprocessors))


@pytest.mark.gpu
def test_benchmark_reports_bandwidth() -> None:
    from cmpchat.bench.kernels.attention import benchmark_decode_attention

    result = benchmark_decode_attention(batch=1, num_heads=16, num_kv_heads=4, context=32768, repeats=5)
    assert result["kv_gbps"] > 0 and result["copy_gbps"] > 0
    print(result)
