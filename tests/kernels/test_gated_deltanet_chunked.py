"""The GDN prefill kernels (chunked and token by token) against the reference layer and the decode kernels.

The reference is `GatedDeltaNet.__call__` on T rows (the numpy token-by-token recurrence), fed the fused
projection as in `test_gated_deltanet`. Simulator tests use tiny heads (dk = 32, the smallest the shapes take)
and short prompts; GPU tests (`-m gpu`) the 9B and 27B head counts and prompts up to 4096 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.reference.gated_deltanet import RecurrentState
from cmpchat.bench.kernels.gdn_chunked import benchmark_prefill, main
from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, decode_step
from cmpchat.kernels.gated_deltanet_chunked import (
    ChunkWorkspace,
    prefill_launches,
)
from tests.kernels.test_gated_deltanet import SHAPES_9B, SHAPES_27B, Layer, assert_close, gdn_config, random_states

TINY = gdn_config(num_k_heads=2, num_v_heads=4, k_head_dim=32, v_head_dim=32)


def run_prefill(layer: Layer, projection: np.ndarray, conv: np.ndarray, delta: np.ndarray, slot: int, **options):
    """The prefill launches on copies of the states; returns out, conv_state, delta_state on the host."""
    shape = layer.shape
    conv_device, delta_device = cuda.to_device(conv), cuda.to_device(delta)
    out = cuda.to_device(np.full((projection.shape[0], shape.output_width), np.nan, np.float32))
    projection_device = cuda.to_device(projection)
    for launch in prefill_launches(
        shape, layer.weights, projection_device, conv_device, delta_device, slot, out, **options
    ):
        launch.run()
    cuda.synchronize()
    np.testing.assert_array_equal(projection_device.copy_to_host(), projection, err_msg="projection changed")
    return out.copy_to_host(), conv_device.copy_to_host(), delta_device.copy_to_host()


def check_against_reference(
    layer: Layer,
    steps: int,
    rng: np.random.Generator,
    *,
    num_slots: int = 2,
    rel: float = 1e-5,
    a_shift: float = 0.0,
    variants: tuple[dict, ...] = ({"chunk": 16}, {"chunked": False}),
) -> np.ndarray:
    """Prefill `steps` random tokens into the last slot from random states, for each launch variant; returns
    the projection used."""
    shape = layer.shape
    conv, delta = random_states(shape, num_slots, rng)
    projection = rng.standard_normal((steps, shape.projection_width)).astype(np.float32)
    projection[:, -shape.num_v_heads :] += a_shift  # alpha logits: larger -> faster decay
    slot = num_slots - 1
    state = RecurrentState(conv[slot].copy(), delta[slot].copy())
    expected = layer.reference(projection, state)
    for options in variants:
        out, conv_after, delta_after = run_prefill(layer, projection, conv, delta, slot, **options)
        assert np.isfinite(out).all(), options
        assert_close(out, expected, rel, f"{options} output")
        assert_close(conv_after[slot], state.conv, 1e-6, f"{options} conv state")
        assert_close(delta_after[slot], state.delta, rel, f"{options} recurrent state")
        np.testing.assert_array_equal(conv_after[:slot], conv[:slot], err_msg="another slot's conv state changed")
        np.testing.assert_array_equal(delta_after[:slot], delta[:slot], err_msg="another slot's state changed")
    return projection


# -- simulator (tiny shapes) -------------------------------------------------------------------------


def test_several_chunks_and_a_partial_one_match_the_reference():
    rng = np.random.default_rng(0)
    check_against_reference(Layer.random(TINY, rng), 37, rng)


def test_a_longer_chunk_in_a_workspace_carved_from_one_buffer():
    rng = np.random.default_rng(1)
    layer = Layer.random(TINY, rng)
    buffer = cuda.to_device(np.full(ChunkWorkspace.nbytes(layer.shape, 40, 32) // 4, np.nan, np.float32))
    workspace = ChunkWorkspace.from_buffer(buffer, layer.shape, 19, 32)
    check_against_reference(layer, 19, rng, variants=({"chunk": 32, "workspace": workspace},))
    with pytest.raises(ValueError, match="needs"):
        ChunkWorkspace.from_buffer(buffer, layer.shape, 41, 32)


@pytest.mark.parametrize("steps", [1, 2])
def test_prompts_shorter_than_the_conv_history(steps):
    """T < K-1: the new conv state keeps some of the old one, shifted."""
    rng = np.random.default_rng(2 + steps)
    check_against_reference(Layer.random(TINY, rng), steps, rng, variants=({"chunk": 8}, {"chunked": False}))


def test_key_and_value_heads_of_different_sizes_and_several_column_tiles():
    """dv = 64: two 32-column slices of each state; Hk = 1 key head for Hv = 3 value heads."""
    rng = np.random.default_rng(6)
    config = gdn_config(num_k_heads=1, num_v_heads=3, k_head_dim=32, v_head_dim=64, rms_eps=1e-5)
    check_against_reference(Layer.random(config, rng), 9, rng, num_slots=3, variants=({"chunk": 8}, {"chunked": False}))


def test_strong_decays():
    """alpha logits shifted by +60: g = ssm_a * softplus(~60) is -6 to -300 per token, so the cumulative log decay
    of a chunk passes -88 (e^-gamma would overflow fp32) for most heads; the kernels never form it."""
    rng = np.random.default_rng(7)
    layer = Layer.random(TINY, rng)
    projection = check_against_reference(layer, 12, rng, a_shift=60.0, variants=({"chunk": 8}, {"chunked": False}))
    alpha_logits = projection[:, -TINY.num_v_heads :].astype(np.float64)
    g = layer.reference.a * np.logaddexp(0, alpha_logits + layer.reference.dt_bias)
    assert (g[:8].sum(axis=0) < -88).sum() >= 3


def test_equals_the_decode_kernels_run_token_by_token():
    """The same tokens through `decode_step` once per token (the decode path) and through the prefill paths."""
    rng = np.random.default_rng(8)
    layer = Layer.random(gdn_config(num_k_heads=1, num_v_heads=2, k_head_dim=32, v_head_dim=32), rng)
    shape = layer.shape
    steps = 5
    conv, delta = random_states(shape, 1, rng)
    projection = rng.standard_normal((steps, shape.projection_width)).astype(np.float32)
    conv_device, delta_device = cuda.to_device(conv), cuda.to_device(delta)
    slots = cuda.to_device(np.zeros(1, np.int32))
    stepped = np.zeros((steps, shape.output_width), np.float32)
    for t in range(steps):
        out = cuda.device_array((1, shape.output_width), np.float32)
        mixed = cuda.device_array((1, shape.conv_dim), np.float32)
        row = cuda.to_device(projection[t : t + 1])
        for launch in decode_step(shape, layer.weights, row, conv_device, delta_device, slots, out, mixed):
            launch.run()
        stepped[t] = out.copy_to_host()[0]
    for options in ({"chunk": 8}, {"chunked": False}):
        out, conv_after, delta_after = run_prefill(layer, projection, conv, delta, 0, **options)
        assert_close(out, stepped, 1e-5, f"{options} output")
        np.testing.assert_array_equal(conv_after, conv_device.copy_to_host())  # the same raw inputs
        assert_close(delta_after, delta_device.copy_to_host(), 1e-5, f"{options} recurrent state")


def test_launcher_checks_and_workspace_sizes():
    rng = np.random.default_rng(9)
    layer = Layer.random(TINY, rng)
    shape = layer.shape
    conv, delta = random_states(shape, 2, rng)
    projection = np.zeros((5, shape.projection_width), np.float32)
    out = np.zeros((5, shape.output_width), np.float32)
    launches = prefill_launches(shape, layer.weights, projection, conv, delta, 1, out, chunk=8)
    assert [launch.dispatcher.__name__ for launch in launches] == [
        "gdn_prefill_conv",
        "gdn_chunk_prepare",
        "gdn_chunk_state",
        "gdn_chunk_output",
        "gdn_prefill_gated_norm",
    ]
    assert launches[1].block == (4,) and launches[1].grid == (1, 4)
    assert launches[2].block == (32,) and launches[2].grid == (4, 2)  # max(2C, dk) threads; (Hv, dv / 16)
    assert launches[3].block == (16,) and launches[3].grid == (1, 4, 1)  # 2C threads; (dv / 32, Hv, chunks)
    sequential = prefill_launches(shape, layer.weights, projection, conv, delta, 1, out, chunked=False)
    assert [launch.dispatcher.__name__ for launch in sequential][1] == "gdn_prefill_sequential"
    with pytest.raises(ValueError, match="chunk must be one of"):
        prefill_launches(shape, layer.weights, projection, conv, delta, 1, out, chunk=12)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        prefill_launches(shape, layer.weights, projection, conv, delta, 2, out)
    with pytest.raises(ValueError, match="mixed must be a buffer of its own"):
        prefill_launches(shape, layer.weights, projection, conv, delta, 0, out, mixed=projection)
    with pytest.raises(ValueError, match="at least one token"):
        prefill_launches(shape, layer.weights, projection[:0], conv, delta, 0, out[:0])
    with pytest.raises(ValueError, match="out must have shape"):
        prefill_launches(shape, layer.weights, projection, conv, delta, 0, out[:4])
    small = ChunkWorkspace.allocate(shape, 4, 8)
    with pytest.raises(ValueError, match="workspace.w must have shape"):
        prefill_launches(shape, layer.weights, projection, conv, delta, 0, out, chunk=8, workspace=small)
    with pytest.raises(ValueError, match="key heads up to 128"):
        prefill_launches(GatedDeltaNetShape(1, 1, 256, 32, 4, 1e-6), layer.weights, projection, conv, delta, 0, out)
    with pytest.raises(ValueError, match="dk a power of two"):
        prefill_launches(GatedDeltaNetShape(1, 1, 96, 32, 4, 1e-6), layer.weights, projection, conv, delta, 0, out)
    # 9B at 4096 tokens: W (32*4096*128) + Q K^T (32*64*64*64) + chunk-start states (64*32*128*128) + decays
    # (32*4096*2), fp32.
    nine_b = GatedDeltaNetShape.from_config(SHAPES_9B)
    expected = 32 * 4096 * 128 + 32 * 64 * 64 * 64 + 64 * 32 * 128 * 128 + 32 * 4096 * 2
    assert ChunkWorkspace.nbytes(nine_b, 4096) == 4 * expected


# -- GPU (real head counts) --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SHAPES_9B, SHAPES_27B], ids=["9B", "27B"])
@pytest.mark.parametrize("steps", [64, 1000, 4096])
def test_real_shapes_against_numpy(config, steps):
    rng = np.random.default_rng(steps)
    check_against_reference(
        Layer.random(config, rng), steps, rng, rel=1e-4, variants=({"chunk": 64}, {"chunked": False})
    )


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_real_shapes_chunk_lengths_and_strong_decay(chunk):
    rng = np.random.default_rng(chunk)
    check_against_reference(
        Layer.random(SHAPES_27B, rng), 300, rng, rel=1e-4, a_shift=30.0, variants=({"chunk": chunk},)
    )


@pytest.mark.gpu
def test_benchmark_compares_chunked_and_token_by_token(capsys):
    result = benchmark_prefill(GatedDeltaNetShape.from_config(SHAPES_9B), 1160, replays=2)
    print(result)
    assert result["chunked_us"] > 0 and result["sequential_us"] > 0
    for kernel_name in (
        "gdn_prefill_conv",
        "gdn_chunk_prepare",
        "gdn_chunk_state",
        "gdn_chunk_output",
        "gdn_prefill_sequential",
    ):
        assert result[f"{kernel_name}_us"] > 0
    assert main(["9B", "--tokens", "256", "--replays", "1"]) == 0
    assert "9B" in capsys.readouterr().out
