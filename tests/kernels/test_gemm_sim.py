"""The prefill GEMM under the CUDA simulator at tiny shapes: Q8_0 x int8 against the reference `Linear`
int8 path and float64, every epilogue, every compiled tiling, the tiling arithmetic and the launcher's checks.

The simulator runs a Python thread per CUDA thread (1-warp blocks of 32 rows x 32 tokens by default), so
shapes stay at a few blocks; they still reach every path: row and token tails, several stages with a
partial last one, SwiGLU row pairs, the GPU's multi-warp tilings."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

from cmpchat.backends.reference.layers import Linear, silu
from cmpchat.cudart.intrinsics import WARP_SIZE
from cmpchat.kernels.gemm import (
    GPU_TILING,
    LANE_TOKEN_GROUPS,
    SIMULATOR_TILING,
    SM70_TILING,
    SWEEP_TILINGS,
    GemmTiling,
    gemm_grid,
    gemm_q8_launch,
    matmul_kind,
)
from cmpchat.kernels.gemv import repack_q8_0
from cmpchat.model.gguf_file import ModelFile
from tests.kernels.test_gemv_sim import RTOL, activations, assert_close, expected_product, random_q8


def run_gemm(
    raw: np.ndarray, rows: int, cols: int, x: np.ndarray, mode: str = "store", out=None, tiling=SIMULATOR_TILING
) -> np.ndarray:
    weight_quants, weight_scales = repack_q8_0(raw, rows, cols)
    x_quants, x_scales = activations(x)
    if out is None:
        out = np.zeros((len(x), rows // 2 if mode == "swiglu" else rows), np.float32)
    gemm_q8_launch(weight_quants, weight_scales, x_quants, x_scales, out, mode=mode, tiling=tiling).run()
    return out


def assert_swiglu_close(actual: np.ndarray, expected: np.ndarray, magnitude: np.ndarray) -> None:
    """silu(gate) * up within the error the gate and up sums may carry (as the GEMV tests bound it)."""
    half = expected.shape[1] // 2
    gate, up = expected[:, :half], expected[:, half:]
    reference = silu(gate) * up
    bound = RTOL * (magnitude[:, :half] * np.abs(up) + np.abs(gate) * magnitude[:, half:]) + 1e-6 * np.abs(reference)
    assert (np.abs(actual - reference) <= bound + 1e-30).all()


def check_mode(raw: np.ndarray, rows: int, cols: int, x: np.ndarray, mode: str, tiling: GemmTiling) -> None:
    expected, magnitude = expected_product(raw, rows, cols, x)
    if mode == "swiglu":
        assert_swiglu_close(run_gemm(raw, rows, cols, x, mode, tiling=tiling), expected, magnitude)
    elif mode == "accumulate":
        residual = np.random.default_rng(rows).standard_normal((len(x), rows)).astype(np.float32)
        summed = run_gemm(raw, rows, cols, x, mode, residual.copy(), tiling=tiling)
        assert_close(summed, expected + residual, magnitude + np.abs(residual))
    else:
        assert_close(run_gemm(raw, rows, cols, x, tiling=tiling), expected, magnitude)


def test_equals_the_reference_linear_int8_path(tiny_model_path: Path) -> None:
    model = ModelFile(tiny_model_path)
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_qkv.weight"):
        rows, tokens = 10, 20  # rows are independent: a slice keeps the simulator quick
        linear = Linear(model, name, mirror_gpu=True)
        x = rng.standard_normal((tokens, linear.in_features)).astype(np.float32)
        expected = linear(x)[:, :rows]
        raw = np.ascontiguousarray(model.raw(name).reshape(linear.out_features, -1)[:rows])
        actual = run_gemm(raw, rows, linear.in_features, x)
        _, magnitude = expected_product(raw, rows, linear.in_features, x)
        assert_close(actual, expected, magnitude)


@pytest.mark.parametrize(
    "mode,rows,tokens",
    [
        ("store", 40, 40),  # 2 x 2 tiles of 32 rows x 32 tokens, both with tails
        ("accumulate", 40, 20),
        ("swiglu", 2 * 20, 20),  # 20 gate rows: two tiles of 16 gate + 16 up rows
    ],
)
def test_epilogues_and_tails(mode: str, rows: int, tokens: int) -> None:
    rng = np.random.default_rng(rows + tokens)
    cols = 160  # 5 blocks: stages of 2, the last one partial
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    check_mode(raw, rows, cols, x, mode, SIMULATOR_TILING)


@pytest.mark.parametrize(
    "tiling,mode",
    [(tiling, ("swiglu", "store", "accumulate")[n % 3]) for n, tiling in enumerate(SWEEP_TILINGS)],
    ids=lambda value: value if isinstance(value, str) else value.label,
)
def test_the_gpu_tilings(tiling: GemmTiling, mode: str) -> None:
    """The multi-warp tilings the GPU runs, one block each (row and token tails inside it)."""
    rng = np.random.default_rng(tiling.threads + tiling.stage_blocks)
    rows = tiling.tile_rows - 6
    tokens = tiling.tile_tokens - 3
    cols = 160  # 5 blocks: stages of 2, the last partial, each prefetched while the one before computes
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    check_mode(raw, rows, cols, x, mode, tiling)


def test_matmul_kind_hands_more_than_16_tokens_to_the_gemm() -> None:
    assert [matmul_kind(t) for t in (1, 2, 16, 17, 64, 2048)] == ["gemv"] * 3 + ["gemm"] * 3
    with pytest.raises(ValueError, match="no tokens"):
        matmul_kind(0)


def test_grid_covers_rows_and_tokens() -> None:
    tiling = GPU_TILING  # 64 rows x 64 tokens
    assert gemm_grid(4096, 512, "store", tiling) == (8, 64)
    assert gemm_grid(4097, 65, "accumulate", tiling) == (2, 65)
    assert gemm_grid(2 * 12288, 2048, "swiglu", tiling) == (32, 384)  # 32 gate rows per tile
    assert gemm_grid(2 * 33, 1, "swiglu", tiling) == (1, 2)


@pytest.mark.parametrize("tiling", [*SWEEP_TILINGS, SIMULATOR_TILING], ids=lambda tiling: tiling.label)
def test_tiling_arithmetic(tiling: GemmTiling) -> None:
    """Staging covers every value, shared memory stays under the 48 KB needing no opt-in, and the inner
    loop's 16-byte shared reads are free of bank conflicts (checked on the word addresses it uses)."""
    w_rounds, x_rounds, ws_rounds, xs_rounds = tiling.staging_rounds()
    groups = tiling.stage_words // 4
    assert w_rounds * tiling.threads >= tiling.tile_rows * groups
    assert x_rounds * tiling.threads >= tiling.tile_tokens * groups
    assert ws_rounds * tiling.threads >= tiling.tile_rows * tiling.stage_blocks
    assert xs_rounds * tiling.threads >= tiling.tile_tokens * tiling.stage_blocks
    assert tiling.shared_bytes() <= 48 * 1024
    assert tiling.pitch % 4 == 0  # 16-byte aligned rows

    # One quarter-warp (8 lanes: one row group, 8 token groups) reading token j's words w..w+3 of a block:
    # 8 distinct addresses on 8 distinct groups of 4 banks.
    for j in range(4):
        for block in range(tiling.stage_blocks):
            for word in (0, 4):
                tokens = [tg + tiling.token_groups * j for tg in range(LANE_TOKEN_GROUPS)]
                starts = [token * tiling.pitch + 8 * block + word for token in tokens]
                assert len({(start % 32) // 4 for start in starts}) == LANE_TOKEN_GROUPS
    # The scale staging stores of one warp (consecutive g: block fastest) hit distinct banks.
    pitch = tiling.tile_rows + tiling.scale_pad
    banks = [((g % tiling.stage_blocks) * pitch + g // tiling.stage_blocks) % 32 for g in range(32)]
    assert len(set(banks)) == 32


def test_bad_tilings_are_refused() -> None:
    for args in ((0, 1, 2), (1, 1, 3), (1, 0, 2)):
        with pytest.raises(ValueError, match="bad GEMM tiling"):
            GemmTiling(*args)


def test_launcher_rejects_bad_arguments() -> None:
    rng = np.random.default_rng(2)
    quants, scales = repack_q8_0(random_q8(rng, 4, 64), 4, 64)
    x_quants, x_scales = activations(rng.standard_normal((20, 64)).astype(np.float32))
    out = np.zeros((20, 4), np.float32)
    launch = partial(gemm_q8_launch, tiling=SIMULATOR_TILING)
    launch(quants, scales, x_quants, x_scales, out)  # the valid call
    with pytest.raises(ValueError, match="weight scales"):
        launch(quants, scales.astype(np.float32), x_quants, x_scales, out)
    with pytest.raises(ValueError, match="activation quants"):
        launch(quants, scales, x_quants[:, :8].copy(), x_scales, out)
    with pytest.raises(ValueError, match="activation scales"):
        launch(quants, scales, x_quants, x_scales[:19].copy(), out)
    with pytest.raises(ValueError, match="out"):
        launch(quants, scales, x_quants, x_scales, np.zeros((20, 2), np.float32))
    with pytest.raises(ValueError, match="mode"):
        launch(quants, scales, x_quants, x_scales, out, mode="add")
    with pytest.raises(ValueError, match="even row count"):
        launch(quants[:3].copy(), scales[:3].copy(), x_quants, x_scales, out[:, :1].copy(), mode="swiglu")
    with pytest.raises(ValueError, match="multiple of 32"):
        launch(quants[:, :12].copy(), scales[:, :1].copy(), x_quants[:, :12].copy(), x_scales[:, :1], out)
    with pytest.raises(ValueError, match="no tokens"):
        launch(quants, scales, np.zeros((0, 16), np.uint32), np.zeros((0, 2), np.float32), out[:0])
    unaligned = np.zeros(4 * 16 + 1, np.uint32)[1:].reshape(4, 16)
    with pytest.raises(ValueError, match="16-byte boundary"):
        launch(unaligned, scales, x_quants, x_scales, out)


def test_benchmark_shapes_and_op_count() -> None:
    """The benchmark times every prefill projection (the LM head runs for the last token only, on the GEMV)
    and counts 2 * rows * cols * T ops, 8 per dp4a like the DP4A probe."""
    from cmpchat.bench.kernels.gemm import PREFILL_SHAPES, GemmTiming

    assert all(name != "lm head" for shapes in PREFILL_SHAPES.values() for name, *_ in shapes)
    assert ("ffn gate+up", 2 * 12288, 4096, "swiglu") in PREFILL_SHAPES["9B"]
    assert ("ffn down", 5120, 17408, "accumulate") in PREFILL_SHAPES["27B"]
    timing = GemmTiming("attn output", 4096, 4096, 512, "accumulate", seconds=1e-3)
    assert timing.ops == 2 * 4096 * 4096 * 512
    assert timing.tops == pytest.approx(2 * 4096 * 4096 * 512 / 1e-3 / 1e12)


def test_the_device_table_runs_the_simulators_tiling_here_and_every_gpu_row_is_swept() -> None:
    from cmpchat.kernels.device_table import SIMULATOR_TUNING, DeviceSpec, tuning_for

    assert SIMULATOR_TUNING.gemm == SIMULATOR_TILING
    assert tuning_for(DeviceSpec((7, 0), 80)).gemm == SM70_TILING  # the CMP 100-210
    assert tuning_for(DeviceSpec((8, 6), 84)).gemm == tuning_for(DeviceSpec((9, 0), 132)).gemm == GPU_TILING
    assert GPU_TILING in SWEEP_TILINGS and SM70_TILING in SWEEP_TILINGS
    assert SM70_TILING.blocks_per_sm * SM70_TILING.threads // WARP_SIZE == 12  # 168 registers a thread
