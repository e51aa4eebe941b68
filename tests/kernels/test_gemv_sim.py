"""The GEMV kernels under the CUDA simulator at tiny shapes: Q8_0 x int8 against the reference `Linear`
int8 path, the epilogues, the float-weight fallback, and the launchers' checks.

The simulator runs a Python thread per CUDA thread (2 warps per block there), so shapes stay at a few
blocks; the shapes still reach every path: row tails, several staged chunks, odd row counts, padded
token buckets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmpchat.backends.reference.layers import Linear, silu
from cmpchat.kernels.gemv import gemv_q8_launch, repack_q8_0, token_bucket
from cmpchat.kernels.gemv_float import gemv_float_launch
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import q8_0_dequantize, q8_0_quantize, q8_0_split, quantize_activations

RTOL = 1e-5  # of the sum of |terms|: fp32 summation order is the only difference


def activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The GEMV's activation operands (as quantize.py writes them) for fp32 rows x."""
    quants, scales = quantize_activations(x)
    return np.ascontiguousarray(quants).view(np.uint32), scales


def expected_product(raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, sum of |terms|) in float64 for the int8 path: sum over blocks of int dot * both block scales."""
    scales, quants = q8_0_split(raw, rows, cols)
    weight = q8_0_dequantize(scales, quants).astype(np.float64)
    xq, xs = quantize_activations(x)
    dequantized_x = (xq.reshape(len(x), -1, 32) * xs[..., None].astype(np.float64)).reshape(len(x), cols)
    return dequantized_x @ weight.T, np.abs(dequantized_x) @ np.abs(weight).T


def assert_close(actual: np.ndarray, expected: np.ndarray, magnitude: np.ndarray) -> None:
    excess = np.abs(actual - expected) - RTOL * magnitude - 1e-30
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"


def random_q8(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return q8_0_quantize((rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32))


def run_q8(raw: np.ndarray, rows: int, cols: int, x: np.ndarray, mode: str = "store", out=None) -> np.ndarray:
    weight_quants, weight_scales = repack_q8_0(raw, rows, cols)
    x_quants, x_scales = activations(x)
    if out is None:
        out = np.zeros((len(x), rows // 2 if mode == "swiglu" else rows), np.float32)
    gemv_q8_launch(weight_quants, weight_scales, x_quants, x_scales, out, mode=mode).run()
    return out


def test_equals_the_reference_linear_int8_path(tiny_model_path: Path) -> None:
    model = ModelFile(tiny_model_path)
    rng = np.random.default_rng(0)
    for name, tokens in (("blk.0.ffn_down.weight", 1), ("blk.0.attn_qkv.weight", 3)):
        rows = 10  # rows are independent: a slice keeps the simulator quick
        linear = Linear(model, name, mirror_gpu=True)
        x = rng.standard_normal((tokens, linear.in_features)).astype(np.float32)
        expected = linear(x)[:, :rows]
        raw = model.raw(name).reshape(linear.out_features, -1)[:rows]
        actual = run_q8(np.ascontiguousarray(raw), rows, linear.in_features, x)
        _, magnitude = expected_product(np.ascontiguousarray(raw), rows, linear.in_features, x)
        assert_close(actual, expected, magnitude)


def test_epilogues_store_accumulate_and_swiglu() -> None:
    rng = np.random.default_rng(1)
    rows, cols, tokens = 12, 160, 2
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    expected, magnitude = expected_product(raw, rows, cols, x)

    assert_close(run_q8(raw, rows, cols, x), expected, magnitude)

    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    summed = run_q8(raw, rows, cols, x, "accumulate", residual.copy())
    assert_close(summed, expected + residual, magnitude + np.abs(residual))

    gate, up = expected[:, : rows // 2], expected[:, rows // 2 :]
    swiglu = run_q8(raw, rows, cols, x, "swiglu")
    reference = silu(gate) * up
    bound = RTOL * (magnitude[:, : rows // 2] * np.abs(up) + np.abs(gate) * magnitude[:, rows // 2 :]) + 1e-6 * np.abs(
        reference
    )
    assert (np.abs(swiglu - reference) <= bound + 1e-30).all()


@pytest.mark.parametrize(
    "rows,cols,tokens",
    [
        (5, 4352, 1),  # two staged chunks (1024 words per token for T=1), odd rows: a clamped dead row
        (4, 1056, 9),  # token bucket 16 padded, two chunks of 256 words per token
        (3, 544, 6),  # token bucket 8 padded, one partial chunk (staged in batches, clamped past the ends)
    ],
)
def test_chunks_tails_and_buckets(rows: int, cols: int, tokens: int) -> None:
    rng = np.random.default_rng(rows * cols + tokens)
    raw = random_q8(rng, rows, cols)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    expected, magnitude = expected_product(raw, rows, cols, x)
    assert_close(run_q8(raw, rows, cols, x), expected, magnitude)


def test_token_buckets() -> None:
    assert [token_bucket(t) for t in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="split the batch"):
        token_bucket(17)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_float_weights(kind: str) -> None:
    rng = np.random.default_rng(len(kind))
    rows, cols, tokens = 6, 72, 3
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "f32":
        weight, exact = values, values
    elif kind == "f16":
        weight = values.astype(np.float16)
        exact = weight.astype(np.float32)
    else:
        weight = bf16_bits(values)
        exact = (weight.astype(np.uint32) << 16).view(np.float32)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    expected = x.astype(np.float64) @ exact.T.astype(np.float64)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(exact.T.astype(np.float64))

    out = np.zeros((tokens, rows), np.float32)
    gemv_float_launch(weight, x, out, bf16=kind == "bf16").run()
    assert_close(out, expected, magnitude)

    out = np.ones((tokens, rows), np.float32)
    gemv_float_launch(weight, x, out, mode="accumulate", bf16=kind == "bf16").run()
    assert_close(out, expected + 1, magnitude + 1)

    out = np.zeros((tokens, rows // 2), np.float32)
    gemv_float_launch(weight, x, out, mode="swiglu", bf16=kind == "bf16").run()
    gate, up = expected[:, : rows // 2], expected[:, rows // 2 :]
    np.testing.assert_allclose(out, silu(gate) * up, rtol=1e-4, atol=1e-4)


def test_repack_keeps_the_bytes() -> None:
    raw = random_q8(np.random.default_rng(5), 3, 64)
    quants, scales = repack_q8_0(raw, 3, 64)
    ref_scales, ref_quants = q8_0_split(raw, 3, 64)
    assert quants.dtype == np.uint32 and quants.shape == (3, 16) and quants.flags.c_contiguous
    np.testing.assert_array_equal(quants.view(np.int8).reshape(3, 2, 32), ref_quants)
    np.testing.assert_array_equal(scales, ref_scales)


def test_launchers_reject_bad_arguments() -> None:
    rng = np.random.default_rng(2)
    quants, scales = repack_q8_0(random_q8(rng, 4, 64), 4, 64)
    x_quants, x_scales = activations(rng.standard_normal((2, 64)).astype(np.float32))
    out = np.zeros((2, 4), np.float32)
    gemv_q8_launch(quants, scales, x_quants, x_scales, out)  # the valid call
    with pytest.raises(ValueError, match="weight scales"):
        gemv_q8_launch(quants, scales.astype(np.float32), x_quants, x_scales, out)
    with pytest.raises(ValueError, match="activation quants"):
        gemv_q8_launch(quants, scales, x_quants[:, :8].copy(), x_scales, out)
    with pytest.raises(ValueError, match="out"):
        gemv_q8_launch(quants, scales, x_quants, x_scales, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="mode"):
        gemv_q8_launch(quants, scales, x_quants, x_scales, out, mode="add")
    with pytest.raises(ValueError, match="even row count"):
        gemv_q8_launch(quants[:3].copy(), scales[:3].copy(), x_quants, x_scales, out[:, :1].copy(), mode="swiglu")
    with pytest.raises(ValueError, match="split the batch"):
        many = np.zeros((17, 16), np.uint32)
        gemv_q8_launch(quants, scales, many, np.zeros((17, 2), np.float32), np.zeros((17, 4), np.float32))
    unaligned = np.zeros(4 * 16 + 1, np.uint32)[1:].reshape(4, 16)
    with pytest.raises(ValueError, match="16-byte boundary"):
        gemv_q8_launch(unaligned, scales, x_quants, x_scales, out)
    with pytest.raises(ValueError, match="bf16"):
        gemv_float_launch(np.zeros((4, 64), np.uint16), np.zeros((1, 64), np.float32), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv_float_launch(np.zeros((4, 12), np.float32), np.zeros((1, 12), np.float32), np.zeros((1, 4), np.float32))


def test_staging_covers_every_value_for_the_gpu_block_size_too():
    """The simulator runs 2-warp blocks, the GPU 8: staging must cover all values for both (a floor
    division here once left the T=1 scales unstaged on the GPU only)."""
    from cmpchat.kernels.gemv import TOKEN_BUCKETS, WORDS_PER_BLOCK, chunk_words, staging_rounds

    for threads in (64, 256):
        for tokens in TOKEN_BUCKETS:
            groups, scales = staging_rounds(tokens, threads)
            stage_words = tokens * chunk_words(tokens)
            assert groups * threads >= stage_words // 4
            assert scales * threads >= stage_words // WORDS_PER_BLOCK
