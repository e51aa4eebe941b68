"""The Qwen3.5 image encoder on the GPU: `encoder.encode_image`'s computation with DP4A, FP32 and no tensor cores.

`GpuImageEncoder(projector)` uploads the projector once, every matrix quantised to Q8_0 (per 32 inputs an fp16
scale and int8 values, as llama.cpp's Q8_0), and `encode(prepared)` returns the same float32 rows
[merged tokens, text width] as `encode_image(projector, prepared)`, computed on its stream:

    pixels -> int8 -> patch GEMM -> + bias + positions (kernels/vision.py)
    per block: LayerNorm -> int8 -> qkv GEMM -> bias + 2-D rotary -> attention (fp32) -> int8 -> out GEMM (+= states)
               LayerNorm (+ the out bias) -> int8 -> up GEMM -> bias + GELU-tanh -> int8 -> down GEMM (+= states)
    post LayerNorm (+ the last down bias) -> int8 -> (2x2 groups are 4 consecutive rows: the same memory)
    fc1 GEMM -> bias + GELU-erf -> int8 -> fc2 GEMM -> + bias -> host

Every matrix product is the prefill GEMM (`kernels/gemm.py`: Q8_0 weight x int8 activations, DP4A, fp32
sums); the rest is fp32 (`kernels/vision.py`). Against the fp32 reference the int8 rounding of weights and
activations is the only material difference: about 2% RMS of the merged rows on the tiny random fixture
(max 0.04 on values up to 1.5; tests/vision/test_gpu_encoder_sim.py bounds it at 4% and 0.08), and 1.9% RMS
(max 0.06 on values up to 3) at the released shape with random weights, 27 blocks deep (numpy, 1024 patches).
The GPU follows a numpy model of the same int8 path (`quantized_reference`): to 1e-6 under the simulator, and
on a GPU up to the step of a quant that lands the other side of a rounding tie (fp32 sums in another order),
which moved the fixture's rows by up to 0.03 in numpy trials.

Still images (every temporal frame of a patch equal, as `prepare_image` makes them) upload one frame, 768
values a patch instead of 1536, against the patch kernel summed over the frames: half the pixel bytes over a
CMP's 250 MB/s link and half the patch GEMM. The feed-forward width is padded to a multiple of 32 (4304 ->
4320 in the released encoders) with zero weights, which adds nothing. Scratch buffers are kept for the
largest image seen so far (`workspace_bytes`); weights and scratch are what `device_bytes` plans for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.gemm import GemmTiling, gemm_q8_launch
from cmpchat.kernels.gemv import repack_q8_0
from cmpchat.kernels.quantize import QUANT_BLOCK, quantize_launch
from cmpchat.kernels.vision import (
    GPU_ATTENTION,
    ROW_THREADS,
    SIMULATOR_ATTENTION,
    AttentionTiling,
    add_bias_launch,
    add_positions_launch,
    attention_launch,
    bias_act_quantize_launch,
    layer_norm_quantize_launch,
    rotary_launch,
)
from cmpchat.model.quant import q8_0_quantize
from cmpchat.vision.mmproj import Projector, VisionConfig
from cmpchat.vision.preprocess import Grid, PreparedImage

GEMM = "GEMM"
ATTENTION = "attention"
OTHER = "other"
"""Families of the launches (`GpuImageEncoder.launches`): DP4A-bound, FFMA-bound, and memory-bound."""


def padded(n: int) -> int:
    """n rounded up to whole 32-value quantisation blocks."""
    return -(-n // QUANT_BLOCK) * QUANT_BLOCK


def quantize_matrix(weight: np.ndarray, rows: int | None = None, cols: int | None = None) -> tuple[np.ndarray, ...]:
    """A float [out, in] matrix as the GEMM's Q8_0 operands (quants uint32 [rows, cols/4], scales fp16
    [rows, cols/32]), zero-padded to `rows` x `cols` (cols a multiple of 32)."""
    out_features, in_features = weight.shape
    rows, cols = rows or out_features, cols or padded(in_features)
    if rows < out_features or cols < in_features or cols % QUANT_BLOCK:
        raise ValueError(f"cannot pad a {weight.shape} matrix to {rows} x {cols}")
    full = np.zeros((rows, cols), np.float32)
    full[:out_features, :in_features] = weight
    return repack_q8_0(q8_0_quantize(full), rows, cols)


def dequantized(quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 values of the GEMM's Q8_0 operands."""
    rows = quants.shape[0]
    values = quants.view(np.int8).reshape(rows, -1, QUANT_BLOCK).astype(np.float32)
    return (values * scales.astype(np.float32)[:, :, None]).reshape(rows, -1)


def single_frame(image: PreparedImage, config: VisionConfig) -> np.ndarray | None:
    """The pixel rows of one temporal frame [patches, 3 * patch^2] when every frame of every patch is the same
    (a still image), else None."""
    t, p = config.temporal_patch, config.patch_size
    frames = image.pixel_values.reshape(-1, 3, t, p, p)
    first = frames[:, :, :1]
    if t > 1 and not np.array_equal(np.broadcast_to(first, frames.shape), frames):
        return None
    return np.ascontiguousarray(first.reshape(len(frames), 3 * p * p))


def inverse_frequencies(config: VisionConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 4] exactly as `encoder.rotary_tables` computes them."""
    quarter = config.head_dim // 4
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
    return inv_freq.astype(np.float32)


# --- memory ------------------------------------------------------------------------------------------------


def _matrix_shapes(config: VisionConfig) -> list[tuple[int, int]]:
    """(rows, cols) of every uploaded Q8_0 matrix."""
    d, f = config.width, padded(config.ffn_size)
    pixels = 3 * config.patch_size**2
    m = config.merged_width
    per_block = [(3 * d, d), (d, d), (f, d), (d, f)]
    patch = [(d, padded(pixels)), (d, padded(pixels * config.temporal_patch))]
    return patch + per_block * config.depth + [(m, m), (config.projection_dim, m)]


def weight_bytes(config: VisionConfig) -> int:
    """Device bytes of an uploaded projector: Q8_0 matrices (1 + 2/32 bytes a weight), fp32 vectors and tables."""
    d, f = config.width, padded(config.ffn_size)
    matrices = sum(rows * cols + rows * (cols // QUANT_BLOCK) * 2 for rows, cols in _matrix_shapes(config))
    vectors = config.depth * (4 * d + 3 * d + d + f + d) + 3 * d + config.merged_width + config.projection_dim
    vectors += d  # the zero residual bias of the first block
    return matrices + 4 * (vectors + config.position_grid**2 * d + config.head_dim // 4)


def workspace_bytes(config: VisionConfig, patches: int) -> int:
    """Device bytes of the scratch an image of `patches` patches needs (kept for later, smaller images)."""
    d = config.width
    wide = max(padded(config.ffn_size), padded(3 * config.patch_size**2 * config.temporal_patch), d)
    merged = patches // config.merge_size**2
    floats = patches * d + patches * 3 * d + patches * wide + merged * config.projection_dim
    quant_bytes = patches * wide + patches * (wide // QUANT_BLOCK) * 4
    return 4 * floats + quant_bytes


def device_bytes(config: VisionConfig, patches: int) -> int:
    """What the encoder takes on its GPU: the weights, and scratch for images of up to `patches` patches."""
    return weight_bytes(config) + workspace_bytes(config, patches)


# --- device state ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMatrix:
    quants: Any
    scales: Any
    bias: Any

    @property
    def rows(self) -> int:
        return int(self.quants.shape[0])

    @property
    def cols(self) -> int:
        return int(self.quants.shape[1]) * 4


@dataclass(frozen=True)
class DeviceBlock:
    ln1_weight: Any
    ln1_bias: Any
    qkv: DeviceMatrix
    out: DeviceMatrix
    ln2_weight: Any
    ln2_bias: Any
    up: DeviceMatrix
    down: DeviceMatrix


class _Workspace:
    """Flat scratch buffers for up to `capacity` patches, viewed at each image's sizes."""

    def __init__(self, config: VisionConfig, capacity: int) -> None:
        d = config.width
        self.capacity = capacity
        self.wide = max(padded(config.ffn_size), padded(3 * config.patch_size**2 * config.temporal_patch), d)
        merged = capacity // config.merge_size**2
        self.states = cuda.device_array(capacity * d, np.float32)
        self.qkv = cuda.device_array(capacity * 3 * d, np.float32)
        self.scratch = cuda.device_array(capacity * self.wide, np.float32)
        """Pixels, then each block's attention output and MLP hidden rows, then the merger's hidden rows."""
        self.quants = cuda.device_array(capacity * self.wide // 4, np.uint32)
        self.scales = cuda.device_array(capacity * self.wide // QUANT_BLOCK, np.float32)
        self.out = cuda.device_array(merged * config.projection_dim, np.float32)

    @staticmethod
    def view(buffer: Any, rows: int, cols: int) -> Any:
        return buffer[: rows * cols].reshape(rows, cols)

    def activations(self, rows: int, cols: int) -> tuple[Any, Any]:
        """int8 operands for `rows` rows of `cols` values."""
        return self.view(self.quants, rows, cols // 4), self.view(self.scales, rows, cols // QUANT_BLOCK)


class GpuImageEncoder:
    """A projector's weights on one GPU and the launches that encode a prepared image there.

    `tiling`: the GEMM's (default: the GPU's row of the device table); `attention`: the attention kernel's
    (default: the GPU's, or the simulator's small one). Encoding holds a lock: the scratch is shared."""

    def __init__(
        self,
        projector: Projector,
        *,
        gpu_index: int = 0,
        tiling: GemmTiling | None = None,
        attention: AttentionTiling | None = None,
        stream: Any = None,
    ) -> None:
        config = projector.config
        if config.merged_width % QUANT_BLOCK or config.width % QUANT_BLOCK:
            raise ValueError(f"vision width {config.width} is not a multiple of {QUANT_BLOCK}")
        self.config = config
        self.gpu_index = gpu_index
        self.attention = attention or (SIMULATOR_ATTENTION if SIMULATOR else GPU_ATTENTION)
        self._lock = threading.Lock()
        self._workspace: _Workspace | None = None
        with self.on_device():
            if tiling is None:
                from cmpchat.backends.gpu.device import gpu_info
                from cmpchat.kernels.device_table import default_tuning

                tiling = default_tuning(gpu_info(gpu_index)).gemm
            self.tiling = tiling
            self.stream = stream or cuda.stream()
            self._upload(projector)

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Make the encoder's GPU the current one (no-op under the simulator)."""
        if SIMULATOR:
            yield
            return
        with cuda.gpus[self.gpu_index]:
            yield

    # -- weights --------------------------------------------------------------------------------------

    def _upload(self, projector: Projector) -> None:
        config, weights = self.config, projector.weights
        # One host quantisation per distinct array and padding (the benchmark's blocks share theirs); the
        # arrays are held with their quantisations, so no id is reused while the dict lives.
        quantized: dict[tuple[int, int | None, int | None], tuple[np.ndarray, ...]] = {}

        def vector(values: np.ndarray, size: int | None = None) -> Any:
            host = np.zeros(size or len(values), np.float32)
            host[: len(values)] = values
            return cuda.to_device(host, stream=self.stream)

        def matrix(
            weight: np.ndarray, bias: np.ndarray, rows: int | None = None, cols: int | None = None
        ) -> DeviceMatrix:
            key = (id(weight), rows, cols)
            if key not in quantized:
                quantized[key] = (weight, *quantize_matrix(weight, rows, cols))
            _, quants, scales = quantized[key]
            return DeviceMatrix(
                cuda.to_device(quants, stream=self.stream),
                cuda.to_device(scales, stream=self.stream),
                vector(bias, quants.shape[0]),
            )

        d, f = config.width, padded(config.ffn_size)
        kernel = weights.patch_weight  # [d, 3, t, p, p]
        self.patch_full = matrix(kernel.reshape(d, -1), weights.patch_bias)
        self.patch_still = matrix(kernel.sum(axis=2, dtype=np.float32).reshape(d, -1), weights.patch_bias)
        self.positions = cuda.to_device(
            np.ascontiguousarray(weights.position_embedding, np.float32), stream=self.stream
        )
        self.inv_freq = cuda.to_device(inverse_frequencies(config), stream=self.stream)
        self.zeros = vector(np.zeros(d, np.float32))
        self.blocks = [
            DeviceBlock(
                ln1_weight=vector(block.ln1_weight),
                ln1_bias=vector(block.ln1_bias),
                qkv=matrix(block.qkv_weight, block.qkv_bias),
                out=matrix(block.out_weight, block.out_bias),
                ln2_weight=vector(block.ln2_weight),
                ln2_bias=vector(block.ln2_bias),
                up=matrix(block.up_weight, block.up_bias, rows=f),
                down=matrix(block.down_weight, block.down_bias, cols=f),
            )
            for block in weights.blocks
        ]
        self.post_ln_weight = vector(weights.post_ln_weight)
        self.post_ln_bias = vector(weights.post_ln_bias)
        self.fc1 = matrix(weights.merger_fc1_weight, weights.merger_fc1_bias)
        self.fc2 = matrix(weights.merger_fc2_weight, weights.merger_fc2_bias)
        self.stream.synchronize()

    # -- encoding -------------------------------------------------------------------------------------

    def encode(self, image: PreparedImage) -> np.ndarray:
        """float32 [merged tokens, text width]: `encode_image`'s rows, computed on this GPU."""
        with self._lock, self.on_device():
            launches = self.prepare(image)
            for _, launch in launches:
                launch.run(self.stream)
            rows = image.grid.merged_tokens(self.config.merge_size)
            assert self._workspace is not None
            result = self._workspace.view(self._workspace.out, rows, self.config.projection_dim)
            host = result.copy_to_host(stream=self.stream)
            self.stream.synchronize()
            return host

    def prepare(self, image: PreparedImage) -> list[tuple[str, Launch]]:
        """Upload the image's pixels (on the stream) and return the encode's launches, each with its family;
        running them in order on the stream leaves the rows in the workspace's output (benchmarks replay them).
        The caller holds the device current."""
        config = self.config
        grid = image.grid
        patches = grid.frames * grid.rows * grid.cols
        if image.pixel_values.shape[0] != patches:
            raise ValueError(f"{image.pixel_values.shape[0]} pixel rows for a grid of {patches} patches")
        if grid.rows % config.merge_size or grid.cols % config.merge_size:
            raise ValueError(f"grid {grid} is not whole {config.merge_size}x{config.merge_size} groups")
        pixels = single_frame(image, config)
        patch = self.patch_still
        if pixels is None:
            pixels, patch = image.pixel_values, self.patch_full
        if pixels.shape[1] != patch.cols:  # patch sizes whose rows are not whole quantisation blocks
            pixels = np.pad(pixels, ((0, 0), (0, patch.cols - pixels.shape[1])))
        workspace = self._workspace_for(patches)
        device_pixels = workspace.view(workspace.scratch, patches, patch.cols)
        device_pixels.copy_to_device(np.ascontiguousarray(pixels, np.float32), stream=self.stream)
        return self.launches(grid, patch)

    def _workspace_for(self, patches: int) -> _Workspace:
        if self._workspace is None or self._workspace.capacity < patches:
            self._workspace = None  # freed before the larger one is allocated
            self._workspace = _Workspace(self.config, patches)
        return self._workspace

    def launches(self, grid: Grid, patch: DeviceMatrix) -> list[tuple[str, Launch]]:
        """The encode of an image of `grid` whose pixel rows are in the workspace (`prepare`)."""
        config, space = self.config, self._workspace
        assert space is not None
        n = grid.frames * grid.rows * grid.cols
        d, f, m = config.width, padded(config.ffn_size), config.merge_size
        grid_shape = (grid.frames, grid.rows, grid.cols)
        eps = config.layer_norm_eps
        states = space.view(space.states, n, d)
        qkv = space.view(space.qkv, n, 3 * d)
        x_d = space.activations(n, d)
        launches: list[tuple[str, Launch]] = []

        def gemm(matrix: DeviceMatrix, x: tuple[Any, Any], out: Any, mode: str = "store") -> None:
            launch = gemm_q8_launch(matrix.quants, matrix.scales, *x, out, mode=mode, tiling=self.tiling)
            launches.append((GEMM, launch))

        def other(launch: Launch) -> None:
            launches.append((OTHER, launch))

        pixels = space.view(space.scratch, n, patch.cols)
        x_pixels = space.activations(n, patch.cols)
        other(quantize_launch(pixels, *x_pixels, threads=ROW_THREADS))
        gemm(patch, x_pixels, states)
        other(add_positions_launch(states, patch.bias, self.positions, grid_shape, m))
        pending = self.zeros  # the bias of the last product accumulated into the states
        for block in self.blocks:
            other(layer_norm_quantize_launch(states, pending, block.ln1_weight, block.ln1_bias, eps, *x_d))
            gemm(block.qkv, x_d, qkv)
            other(rotary_launch(qkv, block.qkv.bias, self.inv_freq, grid_shape, m, config.num_heads))
            attended = space.view(space.scratch, n, d)
            launches.append((ATTENTION, attention_launch(qkv, attended, config.num_heads, self.attention)))
            other(quantize_launch(attended, *x_d, threads=ROW_THREADS))
            gemm(block.out, x_d, states, "accumulate")
            other(layer_norm_quantize_launch(states, block.out.bias, block.ln2_weight, block.ln2_bias, eps, *x_d))
            hidden = space.view(space.scratch, n, f)
            gemm(block.up, x_d, hidden)
            x_f = space.activations(n, f)
            other(bias_act_quantize_launch(hidden, block.up.bias, "gelu_tanh", *x_f))
            gemm(block.down, x_f, states, "accumulate")
            pending = block.down.bias
        other(layer_norm_quantize_launch(states, pending, self.post_ln_weight, self.post_ln_bias, eps, *x_d))
        merged, width = n // m**2, config.merged_width
        x_merged = space.activations(merged, width)  # the same memory: a group's rows side by side
        hidden = space.view(space.scratch, merged, width)
        gemm(self.fc1, x_merged, hidden)
        other(bias_act_quantize_launch(hidden, self.fc1.bias, "gelu_erf", *x_merged))
        out = space.view(space.out, merged, config.projection_dim)
        gemm(self.fc2, x_merged, out)
        other(add_bias_launch(out, self.fc2.bias))
        return launches


# --- the int8 path in numpy --------------------------------------------------------------------------------


def quantized_reference(projector: Projector, image: PreparedImage) -> np.ndarray:
    """What the GPU computes, in numpy: `encode_image` with every matrix Q8_0 and every product's input int8
    (the tests hold the GPU to this tightly and to the fp32 reference loosely)."""
    from cmpchat.model.quant import quantize_activations
    from cmpchat.vision import encoder

    config, weights = projector.config, projector.weights

    def int8(x: np.ndarray) -> np.ndarray:
        quants, scales = quantize_activations(np.ascontiguousarray(x, np.float32))
        blocks = quants.reshape(*x.shape[:-1], -1, QUANT_BLOCK).astype(np.float32) * scales[..., None]
        return blocks.reshape(x.shape)

    def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        cols = padded(weight.shape[1])
        wide = np.pad(x, ((0, 0), (0, cols - x.shape[1])))
        return int8(wide) @ dequantized(*quantize_matrix(weight)).T + bias

    pixels = single_frame(image, config)
    if pixels is None:
        states = linear(image.pixel_values, weights.patch_weight.reshape(config.width, -1), weights.patch_bias)
    else:
        still = weights.patch_weight.sum(axis=2, dtype=np.float32).reshape(config.width, -1)
        states = linear(pixels, still, weights.patch_bias)
    rows, cols = encoder.patch_coordinates(image.grid, config.merge_size)
    states = states + encoder.resampled_positions(
        weights.position_embedding, config.position_grid, image.grid, rows, cols
    )
    cos, sin = encoder.rotary_tables(rows, cols, config)
    n, h, hd = len(states), config.num_heads, config.head_dim
    for block in weights.blocks:
        x = encoder._layer_norm(states, block.ln1_weight, block.ln1_bias, config)
        qkv = linear(x, block.qkv_weight, block.qkv_bias).reshape(n, 3, h, hd)
        q = encoder._rotate(qkv[:, 0], cos[:, None], sin[:, None])
        k = encoder._rotate(qkv[:, 1], cos[:, None], sin[:, None])
        attended = np.empty((n, h, hd), np.float32)
        for head in range(h):
            scores = (q[:, head] @ k[:, head].T) * np.float32(hd**-0.5)
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            attended[:, head] = (scores / scores.sum(axis=1, keepdims=True)) @ qkv[:, 2, head]
        states = states + linear(attended.reshape(n, -1), block.out_weight, block.out_bias)
        hidden = linear(encoder._layer_norm(states, block.ln2_weight, block.ln2_bias, config), block.up_weight,
                        block.up_bias)  # fmt: skip
        states = states + linear(encoder._gelu_tanh(hidden), block.down_weight, block.down_bias)
    normed = encoder._layer_norm(states, weights.post_ln_weight, weights.post_ln_bias, config)
    grouped = normed.reshape(-1, config.merged_width)
    hidden = encoder._gelu_erf(linear(grouped, weights.merger_fc1_weight, weights.merger_fc1_bias))
    return linear(hidden, weights.merger_fc2_weight, weights.merger_fc2_bias).astype(np.float32)


# --- the released shape, with random weights (benchmarks and GPU tests) -------------------------------------

RELEASED_9B = VisionConfig(
    name="Qwen3.5 vision tower (9B's mmproj shape)",
    width=1152,
    depth=27,
    num_heads=16,
    ffn_size=4304,
    patch_size=16,
    merge_size=2,
    position_grid=48,
    projection_dim=4096,
    layer_norm_eps=1e-6,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)
"""The encoder of the released Qwen3.5 models (transformers' Qwen3_5VisionConfig: 27 blocks of width 1152,
16 heads, MLP 4304, 16-px patches, 2x2 merge, a 48 x 48 position table) projecting to the 9B's width 4096."""


def random_projector(config: VisionConfig = RELEASED_9B, seed: int = 0, *, shared_blocks: bool = True) -> Projector:
    """A projector of `config`'s shape with random weights of a trained model's scale (matrices 1/sqrt(fan-in),
    LayerNorm weights near 1, small biases), no file needed. `shared_blocks`: every block holds the same
    arrays (one block's 15 M weights drawn instead of 27 x; uploads still give each block its own memory)."""
    from cmpchat.vision.mmproj import ProjectorWeights, VisionBlockWeights

    rng = np.random.default_rng(seed)
    d, f, m = config.width, config.ffn_size, config.merged_width

    def normal(shape: tuple[int, ...], scale: float, mean: float = 0.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale) + np.float32(mean)).astype(np.float32)

    def block() -> VisionBlockWeights:
        return VisionBlockWeights(
            ln1_weight=normal((d,), 0.05, 1.0), ln1_bias=normal((d,), 0.02),
            qkv_weight=normal((3 * d, d), d**-0.5), qkv_bias=normal((3 * d,), 0.02),
            out_weight=normal((d, d), d**-0.5), out_bias=normal((d,), 0.02),
            ln2_weight=normal((d,), 0.05, 1.0), ln2_bias=normal((d,), 0.02),
            up_weight=normal((f, d), d**-0.5), up_bias=normal((f,), 0.02),
            down_weight=normal((d, f), f**-0.5), down_bias=normal((d,), 0.02),
        )  # fmt: skip

    first = block()
    blocks = tuple(first if shared_blocks else block() for _ in range(config.depth))
    p, t = config.patch_size, config.temporal_patch
    weights = ProjectorWeights(
        patch_weight=normal((d, 3, t, p, p), (3 * t * p * p) ** -0.5),
        patch_bias=normal((d,), 0.02),
        position_embedding=normal((config.position_grid**2, d), 0.5),
        blocks=blocks,
        post_ln_weight=normal((d,), 0.05, 1.0),
        post_ln_bias=normal((d,), 0.02),
        merger_fc1_weight=normal((m, m), m**-0.5),
        merger_fc1_bias=normal((m,), 0.02),
        merger_fc2_weight=normal((config.projection_dim, m), m**-0.5),
        merger_fc2_bias=normal((config.projection_dim,), 0.02),
    )
    return Projector(config, weights)
