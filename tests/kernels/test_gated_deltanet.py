"""The GDN decode-step kernels against the reference layer (`GatedDeltaNet.__call__` with T=1).

Simulator tests use tiny heads; GPU tests (`-m gpu`) use the 9B and 27B head counts. Each runs several
consecutive steps so the carried conv and recurrent states are checked too, with varying slot mappings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.device import gpu_info
from cmpchat.backends.reference.gated_deltanet import GatedDeltaNet, RecurrentState
from cmpchat.backends.reference.layers import Linear
from cmpchat.bench.kernels.gdn_step import benchmark_decode_step
from cmpchat.cudart.graph import LaunchGraph
from cmpchat.kernels.device_table import default_tuning
from cmpchat.kernels.gated_deltanet import (
    GatedDeltaNetShape,
    GatedDeltaNetWeights,
    decode_step,
)
from cmpchat.model.config import LayerKind, ModelConfig
from cmpchat.model.gguf_file import ModelFile


def gdn_config(
    num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, rms_eps: float = 1e-6
) -> ModelConfig:
    """A config with the GDN sizes that matter here (the attention fields are placeholders)."""
    return ModelConfig(
        name="gdn-test", vocab_size=256, hidden_size=64, ffn_size=64, context_length=64, rms_eps=rms_eps,
        layer_kinds=(LayerKind.RECURRENT,), num_mtp_layers=0, tied_embeddings=True, num_heads=1, num_kv_heads=1,
        head_dim=32, rope_dims=16, rope_theta=1e7, rope_sections=(0, 0, 0, 0), conv_kernel=4,
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, k_head_dim=k_head_dim, v_head_dim=v_head_dim,
    )  # fmt: skip


class Projection(Linear):
    """Stands in for a weight matrix of the reference layer: its output is `function` of the input."""

    def __init__(self, function: Callable[[np.ndarray], np.ndarray]) -> None:  # no weights to load
        self.function = function

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.function(x)


@dataclass
class Layer:
    """Random small tensors of one GDN layer, a reference layer fed the fused projection, and device copies."""

    shape: GatedDeltaNetShape
    reference: GatedDeltaNet
    weights: GatedDeltaNetWeights

    @classmethod
    def random(cls, config: ModelConfig, rng: np.random.Generator) -> Layer:
        shape = GatedDeltaNetShape.from_config(config)
        conv_weight = (0.4 * rng.standard_normal((shape.conv_dim, shape.conv_kernel))).astype(np.float32)
        ssm_a = -np.exp(rng.standard_normal(shape.num_v_heads)).astype(np.float32)
        dt_bias = rng.standard_normal(shape.num_v_heads).astype(np.float32)
        norm_weight = (1.0 + 0.3 * rng.standard_normal(shape.v_head_dim)).astype(np.float32)
        return cls.from_arrays(config, conv_weight, ssm_a, dt_bias, norm_weight)

    @classmethod
    def from_arrays(
        cls,
        config: ModelConfig,
        conv_weight: np.ndarray,
        ssm_a: np.ndarray,
        dt_bias: np.ndarray,
        norm_weight: np.ndarray,
    ) -> Layer:
        shape = GatedDeltaNetShape.from_config(config)
        reference = object.__new__(GatedDeltaNet)  # the real __call__, fed the fused projection as its input
        reference.config = config
        z0 = shape.conv_dim
        b0 = z0 + shape.output_width
        a0 = b0 + shape.num_v_heads
        reference.qkv = Projection(lambda p: p[:, :z0])
        reference.gate = Projection(lambda p: p[:, z0:b0])
        reference.beta = Projection(lambda p: p[:, b0:a0])
        reference.alpha = Projection(lambda p: p[:, a0:])
        reference.out = Projection(lambda y: y)
        reference.conv_weight, reference.a, reference.dt_bias = conv_weight, ssm_a, dt_bias
        reference.norm_weight = norm_weight
        device = [cuda.to_device(np.ascontiguousarray(t)) for t in (conv_weight, ssm_a, dt_bias, norm_weight)]
        return cls(shape, reference, GatedDeltaNetWeights(*device))


def random_states(shape: GatedDeltaNetShape, num_slots: int, rng: np.random.Generator, scale: float = 0.3):
    conv = (scale * rng.standard_normal((num_slots, shape.conv_kernel - 1, shape.conv_dim))).astype(np.float32)
    delta = rng.standard_normal((num_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim))
    return conv, (scale * delta).astype(np.float32)


def assert_close(actual: np.ndarray, expected: np.ndarray, rel: float, what: str) -> None:
    """Normwise: the largest error within `rel` of the largest magnitude (fp32 sums in another order)."""
    scale = max(float(np.abs(expected).max()), 1e-30)
    error = float(np.abs(actual.astype(np.float64) - expected).max())
    assert error <= rel * scale, f"{what}: max error {error:.3g} vs max |value| {scale:.3g} (rel {error / scale:.3g})"


def launches_early() -> bool:
    """Whether the engine would start these kernels early on this GPU (its row of the device table)."""
    gpu = gpu_info(0)
    return default_tuning(gpu).launches_early(gpu)


def run_steps(layer: Layer, slot_plan: list[list[int]], num_slots: int, rng: np.random.Generator, *,
              separate_mixed: bool = False, rel: float = 1e-5, zero_state: bool = False,
              graph: bool = False) -> None:  # fmt: skip
    """Run one decode step per entry of `slot_plan` (slot per batch row, -1 idle) on device and reference.

    With `graph`, the launches are built and captured once (all steps of one batch size) and every step
    only rewrites the projection and slot buffers in place before replaying, as the engine does.
    """
    shape = layer.shape
    conv, delta = random_states(shape, num_slots, rng)
    if zero_state:
        conv[:], delta[:] = 0, 0
    conv_device, delta_device = cuda.to_device(conv), cuda.to_device(delta)
    stream = cuda.stream()
    captured = None
    for step, slots in enumerate(slot_plan):
        projection = rng.standard_normal((len(slots), shape.projection_width)).astype(np.float32)
        slot_array = np.array(slots, np.int32)
        if captured is None:
            projection_device, slots_device = cuda.to_device(projection), cuda.to_device(slot_array)
            out_device = cuda.to_device(np.full((len(slots), shape.output_width), np.nan, np.float32))
            mixed = cuda.to_device(np.zeros((len(slots), shape.conv_dim), np.float32)) if separate_mixed else None
            launches = decode_step(
                shape, layer.weights, projection_device, conv_device, delta_device, slots_device, out_device, mixed
            )
            captured = LaunchGraph.capture(launches, stream, early_launch=launches_early()) if graph else None
        else:  # same buffers, new contents: the captured graph reads them at replay
            projection_device.copy_to_device(projection, stream=stream)
            slots_device.copy_to_device(slot_array, stream=stream)
        if captured is not None:
            captured.replay(stream)
        else:
            for launch in launches:
                launch.run(stream)
        stream.synchronize()

        out = out_device.copy_to_host()
        for row, slot in enumerate(slots):
            if slot < 0:
                np.testing.assert_array_equal(out[row], 0, err_msg="an idle row's output must be zero")
                continue
            state = RecurrentState(conv[slot].copy(), delta[slot].copy())
            expected = layer.reference(projection[row : row + 1], state)[0]
            conv[slot], delta[slot] = state.conv, state.delta
            assert_close(out[row], expected, rel, f"step {step} row {row} output")
        # Every slot at once: active slots advanced, the others untouched.
        assert_close(conv_device.copy_to_host(), conv, rel, f"step {step} conv state")
        assert_close(delta_device.copy_to_host(), delta, rel, f"step {step} recurrent state")
        if separate_mixed:
            np.testing.assert_array_equal(projection_device.copy_to_host(), projection, err_msg="projection changed")
        tail = projection_device.copy_to_host()[:, shape.conv_dim :]
        np.testing.assert_array_equal(tail, projection[:, shape.conv_dim :], err_msg="z, b, a columns changed")


# -- simulator (tiny shapes) -------------------------------------------------------------------------


TINY = gdn_config(num_k_heads=2, num_v_heads=4, k_head_dim=32, v_head_dim=32)


def test_single_sequence_from_zero_state_over_steps():
    rng = np.random.default_rng(0)
    run_steps(Layer.random(TINY, rng), [[0]] * 3, num_slots=1, rng=rng, zero_state=True)


def test_batches_follow_the_slot_mapping_as_it_changes():
    rng = np.random.default_rng(1)
    plan = [[2, 0, 4], [0, 4, 2], [3, 1]]
    run_steps(Layer.random(TINY, rng), plan, num_slots=5, rng=rng)


def test_idle_rows_are_zeroed_and_leave_every_slot_alone():
    rng = np.random.default_rng(2)
    run_steps(Layer.random(TINY, rng), [[1, -1, 3], [-1, -1, 0]], num_slots=4, rng=rng)


def test_one_captured_graph_serves_changing_slots():
    rng = np.random.default_rng(7)
    plan = [[0, 2], [-1, 0], [1, 2]]
    run_steps(Layer.random(TINY, rng), plan, num_slots=3, rng=rng, graph=True)


def test_separate_mixed_buffer_leaves_the_projection_unchanged():
    rng = np.random.default_rng(3)
    layer = Layer.random(TINY, rng)
    run_steps(layer, [[1, 0], [0, 1]], num_slots=2, rng=rng, separate_mixed=True)


def test_a_prompt_chunk_in_one_launch_pair_equals_its_tokens_one_step_each():
    """n rows of one sequence through one launch pair (`tokens_per_sequence`) give the bits of n decode
    steps, idle rows at the end of the chunk included; other slots stay untouched."""
    rng = np.random.default_rng(8)
    layer = Layer.random(TINY, rng)
    shape = layer.shape
    conv, delta = random_states(shape, 3, rng)
    projection = rng.standard_normal((4, shape.projection_width)).astype(np.float32)
    slots = np.array([1, 1, 1, -1], np.int32)

    stepped = cuda.to_device(conv), cuda.to_device(delta)
    expected = np.zeros((4, shape.output_width), np.float32)
    for row in range(3):
        out = cuda.to_device(np.full((1, shape.output_width), np.nan, np.float32))
        for launch in decode_step(shape, layer.weights, cuda.to_device(projection[row : row + 1]), *stepped,
                                  cuda.to_device(slots[row : row + 1]), out):  # fmt: skip
            launch.run()
        expected[row] = out.copy_to_host()[0]

    chunked = cuda.to_device(conv), cuda.to_device(delta)
    out = cuda.to_device(np.full((4, shape.output_width), np.nan, np.float32))
    for launch in decode_step(shape, layer.weights, cuda.to_device(projection), *chunked, cuda.to_device(slots), out,
                              tokens_per_sequence=4):  # fmt: skip
        launch.run()
    cuda.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), expected)
    for got, want in zip(chunked, stepped, strict=True):
        np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())
    with pytest.raises(ValueError, match="whole sequences"):
        decode_step(shape, layer.weights, cuda.to_device(projection), *chunked, cuda.to_device(slots), out,
                    tokens_per_sequence=3)  # fmt: skip


def test_key_and_value_heads_of_different_sizes():
    rng = np.random.default_rng(4)
    config = gdn_config(num_k_heads=1, num_v_heads=3, k_head_dim=32, v_head_dim=64, rms_eps=1e-5)
    run_steps(Layer.random(config, rng), [[0, 1], [1, 0]], num_slots=2, rng=rng)


def test_matches_a_gguf_layer_end_to_end(tiny_model_path):
    """The real layer from a model file: its projections make the fused input, its ssm_out the output."""
    model_file = ModelFile(tiny_model_path)
    config = ModelConfig.from_model_file(model_file)
    index = config.recurrent_layers[0]
    real = GatedDeltaNet(model_file, index, config, mirror_gpu=False)
    layer = Layer.from_arrays(config, real.conv_weight, real.a, real.dt_bias, real.norm_weight)
    shape = layer.shape
    rng = np.random.default_rng(5)
    states = [RecurrentState.empty(config) for _ in range(2)]
    conv_device = cuda.to_device(np.zeros((2, shape.conv_kernel - 1, shape.conv_dim), np.float32))
    delta_device = cuda.to_device(np.zeros((2, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim), np.float32))
    for step in range(3):
        x = rng.standard_normal((2, config.hidden_size)).astype(np.float32)
        projection = np.concatenate([real.qkv(x), real.gate(x), real.beta(x), real.alpha(x)], axis=1)
        out_device = cuda.device_array((2, shape.output_width), np.float32)
        slots = cuda.to_device(np.array([1, 0], np.int32))  # row 0 -> slot 1, row 1 -> slot 0
        for launch in decode_step(
            shape, layer.weights, cuda.to_device(projection), conv_device, delta_device, slots, out_device
        ):
            launch.run()
        gated = out_device.copy_to_host()
        for row, slot in enumerate([1, 0]):
            expected = real(x[row : row + 1], states[slot])[0]
            assert_close(real.out(gated[row : row + 1])[0], expected, 1e-5, f"step {step} row {row}")
        assert_close(delta_device.copy_to_host(), np.stack([s.delta for s in states]), 1e-5, "recurrent state")
        assert_close(
            conv_device.copy_to_host(), np.stack([s.conv for s in states]), 1e-6, "conv state"
        )  # BLAS rows differ


def test_launcher_rejects_wrong_arrays():
    rng = np.random.default_rng(6)
    layer = Layer.random(TINY, rng)
    shape = layer.shape
    conv, delta = random_states(shape, 2, rng)
    projection = np.zeros((2, shape.projection_width), np.float32)
    slots = np.array([0, 1], np.int32)
    out = np.zeros((2, shape.output_width), np.float32)
    with pytest.raises(ValueError, match="slots must be a 1-D int32"):
        decode_step(shape, layer.weights, projection, conv, delta, slots.astype(np.int64), out)
    with pytest.raises(ValueError, match="projection must have 392 columns"):
        decode_step(shape, layer.weights, projection[:, 1:].copy(), conv, delta, slots, out)
    with pytest.raises(ValueError, match="delta_state must have shape"):
        decode_step(shape, layer.weights, projection, conv, delta[:1], slots, out)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        decode_step(
            shape, layer.weights, projection, conv, delta, slots, np.zeros((shape.output_width, 2), np.float32).T
        )
    with pytest.raises(ValueError, match="multiple of"):
        GatedDeltaNetShape(2, 3, 32, 32, 4, 1e-6)


# -- GPU (real head counts) --------------------------------------------------------------------------

SHAPES_9B = gdn_config(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128)
SHAPES_27B = gdn_config(num_k_heads=16, num_v_heads=48, k_head_dim=128, v_head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SHAPES_9B, SHAPES_27B], ids=["9B", "27B"])
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_real_shapes_against_numpy_over_steps(config, batch):
    rng = np.random.default_rng(batch)
    num_slots = batch + 3
    plan = [list(rng.permutation(num_slots)[:batch]) for _ in range(4)]
    plan[2][0] = -1  # one idle row on one step
    run_steps(Layer.random(config, rng), plan, num_slots=num_slots, rng=rng, rel=2e-5)


@pytest.mark.gpu
def test_real_shapes_through_a_captured_graph():
    rng = np.random.default_rng(11)
    plan = [list(rng.permutation(20)[:16]) for _ in range(3)]
    run_steps(Layer.random(SHAPES_9B, rng), plan, num_slots=20, rng=rng, rel=2e-5, graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SHAPES_9B, SHAPES_27B], ids=["9B", "27B"])
@pytest.mark.parametrize("batch", [1, 16])
def test_benchmark_reports_bandwidth(config, batch):
    result = benchmark_decode_step(GatedDeltaNetShape.from_config(config), batch, steps=50)
    print(result)
    assert result["gpu_bound"], "the timed launches did not queue behind the busy-wait: numbers include launch cost"
    assert 0 < result["state_gbps"] and 0 < result["copy_gbps"]
