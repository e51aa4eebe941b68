"""Raw launches, graphs and device scalars under the CUDA simulator, where they fall back to Numba's own
launching: engine code written against them runs in CI with the same results as eager launches.
(tests/kernels/test_launching_gpu.py checks the real driver paths on a GPU.)"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.cudart import selftest_kernels as k
from cmpchat.cudart.device_scalars import DeviceScalars
from cmpchat.cudart.graph import LaunchGraph, StepLaunches
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.raw_launch import RawLaunch


def chain(values, scalars: DeviceScalars) -> list[Launch]:
    position = scalars["position"]
    return [
        Launch(k.add_at_position, 1, 1, (values, position, np.float32(1.0))),
        Launch(k.scale_all, 1, 32, (values, np.float32(2.0))),
        Launch(k.add_at_position, 1, 1, (values, position, np.float32(3.0))),
    ]


def expected_chain(values: np.ndarray, position: int) -> np.ndarray:
    values = values.copy()
    values[position] += 1
    values *= 2
    values[position] += 3
    return values


def test_raw_launch_runs_the_launch():
    values = cuda.to_device(np.arange(8, dtype=np.float32))
    RawLaunch(Launch(k.scale_all, 1, 32, (values, np.float32(3.0))))()
    np.testing.assert_array_equal(values.copy_to_host(), 3 * np.arange(8, dtype=np.float32))


def test_graph_replays_read_device_scalars_set_between_replays():
    start = np.linspace(0, 1, 8, dtype=np.float32)
    values = cuda.to_device(start)
    scalars = DeviceScalars(("position",))
    stream = cuda.stream()
    graph = LaunchGraph.capture(chain(values, scalars), stream)
    expected = start
    for position in (2, 5, 5, 0):
        scalars.set(position=position)
        scalars.upload(stream)
        graph.replay(stream)
        expected = expected_chain(expected, position)
    stream.synchronize()
    np.testing.assert_allclose(values.copy_to_host(), expected)
    assert len(graph) == 3


@pytest.mark.parametrize("use_graph", [True, False])
def test_a_step_runs_once_when_built_then_once_per_run(use_graph):
    values = cuda.to_device(np.ones(8, dtype=np.float32))
    stream = cuda.stream()
    step = StepLaunches.run_then_capture([Launch(k.scale_all, 1, 32, (values, np.float32(2.0)))], stream, use_graph)
    stream.synchronize()
    assert (step.graph is not None) == use_graph
    np.testing.assert_array_equal(values.copy_to_host(), 2)
    step.run(stream)
    step.run(stream)
    stream.synchronize()
    np.testing.assert_array_equal(values.copy_to_host(), 8)
    StepLaunches(step.launches, stream, use_graph)  # building without running leaves the values alone
    stream.synchronize()
    np.testing.assert_array_equal(values.copy_to_host(), 8)


def test_device_scalars_are_one_element_views_of_one_array():
    scalars = DeviceScalars(("position", "length", "token"))
    scalars.set(length=17, token=-4)
    scalars.upload()
    assert scalars.get("length") == 17
    np.testing.assert_array_equal(scalars.device.copy_to_host(), [0, 17, -4])
    assert scalars["token"].copy_to_host().tolist() == [-4]
    with pytest.raises(ValueError):
        DeviceScalars(("a", "a"))


def test_the_decode_kernels_that_may_start_early_are_marked_and_the_combine_is_not():
    """Which kernels are early launches is a measured choice (docs/performance.md, "Early launch"): the one-row decode chain
    and the batched one are, the attention combine is not (it made 4K-32K steps slower). The simulator never
    launches early, and says so."""
    from cmpchat.cudart.compile import is_early_launch
    from cmpchat.cudart.raw_launch import early_launch_allowed
    from cmpchat.kernels import attention, elementwise, gated_deltanet, gemv, gemv_fused, qk_norm_rope, quantize

    early = [
        *gemv_fused.GEMV_FUSED.values(),
        *gemv.GEMV_Q8.values(),
        quantize.quantize_rows,
        quantize.rms_norm_quantize,
        quantize.rms_norm_quantize_keep,
        elementwise.embed_q8_0_kernel,
        qk_norm_rope.qk_norm_rope,
        attention._partial_kernel(4, 256, 4, 4),
        attention._partial_kernel(6, 256, 4, 4),
        gated_deltanet.gdn_conv_step,
        gated_deltanet.gdn_recurrent_step,
        gated_deltanet.gdn_recurrent_prompt,
    ]
    assert all(is_early_launch(dispatcher) for dispatcher in early)
    assert not is_early_launch(attention.attention_combine)
    assert not early_launch_allowed()
    values = np.ones(32, np.float32)
    assert not RawLaunch(Launch(quantize.quantize_rows, 1, 32, (values,)), early_launch=True).early
