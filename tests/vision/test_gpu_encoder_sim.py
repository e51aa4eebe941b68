"""The GPU image encoder under the CUDA simulator: each of kernels/vision.py's kernels alone against numpy at
tiny shapes, then the whole encoder on the tiny fixture (width 64, 2 blocks) against the numpy model of its
int8 path (tightly) and against the fp32 reference `encode_image` (within the int8 error, stated below).

The simulator runs one Python thread per CUDA thread and its GEMM costs ~85 ms a (32 x 32 tile, 32 inputs):
the whole-encoder test takes the fixture's 8-patch image (~25 s); the kernels' multi-tile paths (several query
and key tiles, tails) are covered by their own tests."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.kernels.vision import (
    GPU_ATTENTION,
    SIMULATOR_ATTENTION,
    AttentionTiling,
    add_bias_launch,
    add_positions_launch,
    attention_launch,
    attention_pitches,
    attention_tiling_for,
    bias_act_quantize_launch,
    layer_norm_quantize_launch,
    rotary_launch,
)
from cmpchat.model.quant import quantize_activations
from cmpchat.vision import encoder
from cmpchat.vision.encoder import encode_image
from cmpchat.vision.gpu_encoder import (
    GEMM,
    RELEASED_9B,
    GpuImageEncoder,
    dequantized,
    device_bytes,
    inverse_frequencies,
    quantize_matrix,
    quantized_reference,
    single_frame,
    weight_bytes,
    workspace_bytes,
)
from cmpchat.vision.image_encoder import ImageEncoder
from cmpchat.vision.mmproj import VisionConfig, open_projector
from cmpchat.vision.preprocess import Grid, PixelBudget, PreparedImage
from tests.vision.test_vision_encoder import prepared
from tests.vision.vision_fixtures import FIXTURES, MMPROJ_F32, manifest

INT8_MAX_ERROR = 0.08
INT8_RMS_ERROR = 0.04
"""The int8 path against the fp32 reference on the fixture: measured 0.033-0.037 max and 1.8-2.1% RMS of the
merged rows (values up to ~1.5); weights alone give 1.4%, activations alone 1.1%."""
MIRROR_ERROR = 1e-4
"""The GPU against the numpy model of the same int8 path: fp32 summation order, and a quant that lands the
other side of a rounding tie (1 step of a block's scale), are the only differences (measured 8e-7)."""


def config(width: int = 64, heads: int = 2, grid: int = 4) -> VisionConfig:
    return VisionConfig("test", width, 1, heads, 96, 16, 2, grid, 32, 1e-6, (0.5,) * 3, (0.5,) * 3)


# --- kernels alone -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [Grid(1, 6, 8), Grid(2, 4, 2)])
def test_positions_are_the_resampled_table_plus_the_patch_bias(grid: Grid) -> None:
    rng = np.random.default_rng(grid.rows)
    side, width = 5, 40
    patches = grid.frames * grid.rows * grid.cols
    states = rng.standard_normal((patches, width)).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    table = rng.standard_normal((side * side, width)).astype(np.float32)
    rows, cols = encoder.patch_coordinates(grid, 2)
    expected = (states + bias) + encoder.resampled_positions(table, side, grid, rows, cols)
    add_positions_launch(states, bias, table, (grid.frames, grid.rows, grid.cols), 2).run()
    np.testing.assert_allclose(states, expected, rtol=1e-6, atol=1e-6)


def test_layer_norm_adds_the_pending_bias_and_quantizes() -> None:
    rng = np.random.default_rng(1)
    tokens, n = 3, 160  # 40 words: two rounds of a 32-thread block
    x = (rng.standard_normal((tokens, n)) * 3 + 1).astype(np.float32)
    residual, weight, bias = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    summed = x + residual
    quants = np.zeros((tokens, n // 4), np.uint32)
    scales = np.zeros((tokens, n // 32), np.float32)
    normalized = np.zeros_like(x)
    layer_norm_quantize_launch(x, residual, weight, bias, 1e-6, quants, scales, normalized).run()
    np.testing.assert_array_equal(x, summed)  # written back for the blocks after
    reference = encoder._layer_norm(summed, weight, bias, config())
    np.testing.assert_allclose(normalized, reference, rtol=0, atol=2e-5)
    expected_quants, expected_scales = quantize_activations(normalized)
    np.testing.assert_array_equal(quants.view(np.int8).reshape(tokens, n), expected_quants)
    np.testing.assert_array_equal(scales, expected_scales)
    plain_quants = np.zeros_like(quants)  # the variant without the fp32 rows quantises the same values
    layer_norm_quantize_launch(summed.copy(), np.zeros(n, np.float32), weight, bias, 1e-6, plain_quants,
                               np.zeros_like(scales)).run()  # fmt: skip
    np.testing.assert_array_equal(plain_quants, quants)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu_erf", "none"])
def test_bias_activation_quantize(activation: str) -> None:
    rng = np.random.default_rng(2)
    tokens, n = 2, 96
    x = (rng.standard_normal((tokens, n)) * 2).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    before = x.copy()
    quants = np.zeros((tokens, n // 4), np.uint32)
    scales = np.zeros((tokens, n // 32), np.float32)
    bias_act_quantize_launch(x, bias, activation, quants, scales).run()
    np.testing.assert_array_equal(x, before)
    act = {"gelu_tanh": encoder._gelu_tanh, "gelu_erf": encoder._gelu_erf, "none": lambda v: v}[activation]
    expected = act(x + bias).astype(np.float32)
    expected_quants, expected_scales = quantize_activations(expected)
    np.testing.assert_allclose(scales, expected_scales, rtol=1e-6)
    # a value within an ulp or two of a rounding tie may take the other integer
    steps = np.abs(quants.view(np.int8).reshape(tokens, n).astype(int) - expected_quants)
    assert steps.max() <= 1 and (steps > 0).sum() <= 2


def test_add_bias() -> None:
    x = np.arange(6 * 40, dtype=np.float32).reshape(6, 40)
    bias = np.linspace(-1, 1, 40, dtype=np.float32)
    expected = x + bias
    add_bias_launch(x, bias).run()
    np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("heads,head_dim,grid", [(2, 32, Grid(1, 4, 6)), (1, 72, Grid(2, 2, 2))])
def test_rotary_rotates_q_and_k_and_adds_the_bias(heads: int, head_dim: int, grid: Grid) -> None:
    rng = np.random.default_rng(head_dim)
    width = heads * head_dim
    vision = config(width, heads)
    n = grid.frames * grid.rows * grid.cols
    qkv = rng.standard_normal((n, 3 * width)).astype(np.float32)
    bias = rng.standard_normal(3 * width).astype(np.float32)
    rows, cols = encoder.patch_coordinates(grid, 2)
    cos, sin = encoder.rotary_tables(rows, cols, vision)
    with_bias = (qkv + bias).reshape(n, 3, heads, head_dim)
    q = encoder._rotate(with_bias[:, 0], cos[:, None], sin[:, None]) * np.float32(head_dim**-0.5)
    k = encoder._rotate(with_bias[:, 1], cos[:, None], sin[:, None])
    rotary_launch(qkv, bias, inverse_frequencies(vision), (grid.frames, grid.rows, grid.cols), 2, heads).run()
    got = qkv.reshape(n, 3, heads, head_dim)
    np.testing.assert_allclose(got[:, 0], q, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got[:, 1], k, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[:, 2], with_bias[:, 2])


def attention_reference(qkv: np.ndarray, heads: int) -> np.ndarray:
    n, columns = qkv.shape
    width = columns // 3
    parts = qkv.astype(np.float64).reshape(n, 3, heads, width // heads)
    out = np.empty((n, heads, width // heads))
    for head in range(heads):
        scores = parts[:, 0, head] @ parts[:, 1, head].T
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = weights / weights.sum(axis=1, keepdims=True) @ parts[:, 2, head]
    return out.reshape(n, width)


@pytest.mark.parametrize(
    "patches,heads,head_dim,tiling,scale",
    [
        (48, 2, 32, SIMULATOR_ATTENTION, 1.5),  # 3 query tiles x 2 key tiles, the last half outside the image
        (37, 1, 72, SIMULATOR_ATTENTION, 1.5),  # the released head size: 18 dims a thread, 4 x 4 and a pair
        (5, 2, 16, SIMULATOR_ATTENTION, 1.5),  # fewer patches than a tile
        (40, 3, 40, SIMULATOR_ATTENTION, 1.5),  # 2 x 4 dims and a pair a thread; keys 32 + 8
        # At scale 1.5 the draws of these two reach scores of ~60, where fp32 rounding alone passes 2e-5 (at 67
        # patches: this kernel 2.7e-5, the one before it 2.9e-5); at 1.2 they are within 1e-5.
        (70, 2, 72, AttentionTiling(2), 1.2),  # 2 warps: query tiles of 32 (32 + 32 + 6), key tiles 32 + 32 + 6
        (67, 1, 72, GPU_ATTENTION, 1.2),  # the GPU's block of 4 warps (64 queries: 64 + 3), keys 32 + 32 + 3
    ],
)
def test_attention_over_every_patch(
    patches: int, heads: int, head_dim: int, tiling: AttentionTiling, scale: float
) -> None:
    rng = np.random.default_rng(patches)
    width = heads * head_dim
    qkv = (rng.standard_normal((patches, 3 * width)) * scale).astype(np.float32)
    out = np.full((patches, width), np.nan, np.float32)
    attention_launch(qkv, out, heads, tiling).run()
    # scores reach ~40 here: fp32 carries ~5e-6 of error into the weights
    np.testing.assert_allclose(out, attention_reference(qkv, heads), rtol=0, atol=2e-5)


def test_attention_of_queries_whose_scores_are_all_far_below_zero() -> None:
    """A query whose every score is very negative (and keys past the image, which score 0 if unmasked): the
    running max starts at the first tile's, not at 0, so the weights do not all underflow."""
    rng = np.random.default_rng(7)
    patches, head_dim = 21, 16
    qkv = rng.standard_normal((patches, 3 * head_dim)).astype(np.float32)
    qkv[:, head_dim : 2 * head_dim] = np.abs(qkv[:, head_dim : 2 * head_dim]) + 1
    qkv[:, :head_dim] = -np.abs(qkv[:, :head_dim]) * 20 - 20  # q . k < -300 for every key
    out = np.zeros((patches, head_dim), np.float32)
    attention_launch(qkv, out, 1, SIMULATOR_ATTENTION).run()
    assert np.isfinite(out).all()
    # scores near -400: an fp32 ulp there is 3e-5 of a weight (the kernel before this one: 4.8e-5 too)
    np.testing.assert_allclose(out, attention_reference(qkv, 1), rtol=0, atol=1e-4)


def test_attention_tiling_fits_static_shared_memory() -> None:
    assert GPU_ATTENTION.shared_bytes(72) == 48_128 and attention_tiling_for(72, GPU_ATTENTION) == GPU_ATTENTION
    assert GPU_ATTENTION.threads == 128 and GPU_ATTENTION.tile_queries == 64
    assert attention_tiling_for(96, GPU_ATTENTION) == AttentionTiling(2)
    assert attention_tiling_for(128, GPU_ATTENTION) == AttentionTiling(1)
    with pytest.raises(ValueError, match="48 KB"):
        attention_tiling_for(1024, GPU_ATTENTION)


def test_attention_shared_rows_avoid_bank_conflicts() -> None:
    """The pitches the kernel's docstring reasons about: a warp's 16-byte loads of Q (4 rows), K (8 rows), V (the
    two key halves 4 rows apart, 4 dim lanes each) and P (4 rows x 2 halves) each touch distinct bank quads."""
    for head_dim in (16, 32, 40, 64, 72, 80, 96, 128):
        q_pitch, kv_pitch, p_pitch = attention_pitches(head_dim)
        assert len({(r * q_pitch // 4) % 8 for r in range(4)}) == 4, head_dim
        assert len({(r * kv_pitch // 4) % 8 for r in range(8)}) == 8, head_dim
        assert len({(h * 4 * kv_pitch // 4 + lane) % 8 for h in range(2) for lane in range(4)}) == 8, head_dim
        assert len({(r * p_pitch // 4 + h) % 8 for r in range(4) for h in range(2)}) == 8, head_dim


def test_launchers_reject_bad_arguments() -> None:
    states = np.zeros((8, 64), np.float32)
    with pytest.raises(ValueError, match="grid"):
        add_positions_launch(states, np.zeros(64, np.float32), np.zeros((16, 64), np.float32), (1, 3, 2), 2)
    with pytest.raises(ValueError, match="side"):
        add_positions_launch(states, np.zeros(64, np.float32), np.zeros((15, 64), np.float32), (1, 4, 2), 2)
    with pytest.raises(ValueError, match="heads"):
        attention_launch(np.zeros((8, 3 * 60), np.float32), np.zeros((8, 60), np.float32), 2)
    with pytest.raises(ValueError, match="activation"):
        bias_act_quantize_launch(states, np.zeros(64, np.float32), "relu", np.zeros((8, 16), np.uint32),
                                 np.zeros((8, 2), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="multiples of 32"):
        layer_norm_quantize_launch(np.zeros((2, 40), np.float32), *(np.zeros(40, np.float32),) * 3, 1e-6,
                                   np.zeros((2, 10), np.uint32), np.zeros((2, 1), np.float32))  # fmt: skip


# --- host side ---------------------------------------------------------------------------------------------


def test_q8_matrices_are_padded_with_zeros() -> None:
    weight = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    quants, scales = quantize_matrix(weight, rows=8)
    assert quants.shape == (8, 16) and scales.shape == (8, 2)
    values = dequantized(quants, scales)
    assert not values[5:].any() and not values[:, 40:].any()
    assert np.abs(values[:5, :40] - weight).max() <= np.abs(weight).max() / 127


def test_still_images_send_one_frame() -> None:
    vision = open_projector(MMPROJ_F32).config
    image = prepared("shrink_grey", open_projector(MMPROJ_F32))
    frame = single_frame(image, vision)
    assert frame is not None and frame.shape == (8, 768)
    np.testing.assert_array_equal(frame, image.pixel_values.reshape(8, 3, 2, 256)[:, :, 0].reshape(8, 768))
    moving = image.pixel_values.copy()
    moving[3, 300] += 1  # channel 1, frame 0
    assert single_frame(PreparedImage(moving, image.grid), vision) is None


def test_memory_plan_of_the_released_encoder() -> None:
    released = RELEASED_9B
    weights = weight_bytes(released)
    assert 490e6 < weights < 510e6  # 27 blocks of 15.3 M Q8_0 weights, the merger's 40 M, tables
    hd = workspace_bytes(released, 3520)  # 1280 x 720
    assert 150e6 < hd < 160e6
    assert device_bytes(released, 3520) == weights + hd
    assert workspace_bytes(released, 4 * 3520) == pytest.approx(4 * hd, rel=1e-6)


# --- the whole encoder -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def projector():
    return open_projector(MMPROJ_F32, text_width=32)


def test_the_gpu_encoder_is_the_int8_path_and_near_the_fp32_reference(projector) -> None:
    # The tight check runs on drawn pixels, not a resized file: Pillow's resize changes between releases
    # (13.0 against 12.3 moves the fixture's grey image onto a quant tie: 0.027 apart, 3.6e-7 before).
    gpu = GpuImageEncoder(projector)
    still = prepared("shrink_grey", projector)  # 8 patches, 2 merged tokens
    frame = np.random.default_rng(5).uniform(-1, 1, (8, 3, 1, 256)).astype(np.float32)
    image = PreparedImage(np.repeat(frame, 2, axis=2).reshape(8, -1), still.grid)  # a still: frames equal
    rows = gpu.encode(image)
    assert rows.dtype == np.float32 and rows.shape == (2, 32)
    np.testing.assert_allclose(rows, quantized_reference(projector, image), rtol=0, atol=MIRROR_ERROR)
    reference = encode_image(projector, image)
    assert np.abs(rows - reference).max() < INT8_MAX_ERROR
    assert np.sqrt(((rows - reference) ** 2).mean() / (reference**2).mean()) < INT8_RMS_ERROR


def test_the_encoder_reads_files_once(projector) -> None:
    gpu = GpuImageEncoder(projector)
    images = ImageEncoder(projector, PixelBudget(1024, 2048), encode=gpu.encode)
    path = FIXTURES / manifest()["cases"]["shrink_grey"]["image"]
    rows = images.encode(path).rows
    reference = encode_image(projector, prepared("shrink_grey", projector))
    assert np.abs(rows - reference).max() < INT8_MAX_ERROR
    assert images.encode(path).rows is rows and images.encoded == 1  # cached


def test_moving_frames_take_the_whole_patch_kernel(projector) -> None:
    """Frames that differ (video) go through the Conv3d's whole kernel: the patch GEMM and the positions."""
    gpu = GpuImageEncoder(projector)
    still = prepared("shrink_grey", projector)
    pixels = still.pixel_values.copy()
    pixels.reshape(8, 3, 2, 256)[:, :, 1] *= 0.5
    image = PreparedImage(pixels, still.grid)
    launches = gpu.prepare(image)
    assert [family for family, _ in launches[:2]] == ["other", GEMM]
    for _, launch in launches[:3]:  # quantise, patch GEMM, bias + positions
        launch.run(gpu.stream)
    assert gpu._workspace is not None
    states = gpu._workspace.view(gpu._workspace.states, 8, 64).copy_to_host()
    weights = projector.weights
    quants, scales = quantize_activations(pixels)
    x = (quants.reshape(8, -1, 32) * scales[..., None]).reshape(8, -1)
    kernel = dequantized(*quantize_matrix(weights.patch_weight.reshape(64, -1)))
    rows, cols = encoder.patch_coordinates(image.grid, 2)
    expected = x @ kernel.T + weights.patch_bias
    expected += encoder.resampled_positions(weights.position_embedding, 4, image.grid, rows, cols)
    np.testing.assert_allclose(states, expected, rtol=0, atol=1e-4)


def test_the_scratch_is_kept_for_smaller_images(projector) -> None:
    gpu = GpuImageEncoder(projector)
    gpu.prepare(prepared("grow_rgba", projector))  # 48 patches: uploads only, nothing is run
    space = gpu._workspace
    assert space is not None and space.capacity == 48
    gpu.prepare(prepared("shrink_grey", projector))
    assert gpu._workspace is space


def test_the_image_encoder_opens_a_gpu_encoder(projector) -> None:
    images = ImageEncoder.on_gpu(projector, PixelBudget(1024, 2048))
    assert isinstance(getattr(images._encode, "__self__", None), GpuImageEncoder)  # weights uploaded, none run
    assert ImageEncoder(projector)._encode.func is encode_image  # type: ignore[attr-defined]
