"""GPU self-test, run first on a GPU machine (`cuda/gpu_run.sh` runs this file before every other GPU test):
the intrinsics' inline PTX on the real GPU against numpy, and the raw launch and graph replay paths against
Numba's own launch on small kernels. If this fails, nothing built on these pieces can be trusted."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.cudart import selftest_kernels as k
from cmpchat.cudart.device_scalars import DeviceScalars
from cmpchat.cudart.graph import LaunchGraph
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.raw_launch import RawLaunch

pytestmark = pytest.mark.gpu


def signed_bytes_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)).sum(axis=1)


def test_the_gpu_is_there(record_property):
    device = cuda.get_current_device()
    record_property("device", device.name.decode() if isinstance(device.name, bytes) else str(device.name))
    record_property("compute_capability", ".".join(map(str, device.compute_capability)))
    assert device.compute_capability >= (7, 0)


def test_dp4a_multiplies_signed_bytes_and_accumulates():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (1024, 4), dtype=np.int8)
    b = rng.integers(-128, 128, (1024, 4), dtype=np.int8)
    a[:4] = [[-128] * 4, [127] * 4, [-128, 127, -1, 0], [1, -1, 1, -1]]  # the extremes, mixed signs
    b[:4] = [[-128] * 4, [-128] * 4, [127, -128, -1, 5], [-1, 1, -1, 1]]
    accumulate = rng.integers(-(2**28), 2**28, 1024).astype(np.int32)
    out = cuda.device_array(1024, np.int32)
    words_a, words_b = a.view(np.int32).ravel(), b.view(np.int32).ravel()
    k.dp4a_words[8, 128](cuda.to_device(words_a), cuda.to_device(words_b), cuda.to_device(accumulate), out)
    expected = signed_bytes_dot(words_a, words_b) + accumulate
    np.testing.assert_array_equal(out.copy_to_host(), expected)
    assert out.copy_to_host()[0] - accumulate[0] == 4 * 128 * 128


def test_fma_f32_rounds_once():
    from cmpchat.cudart.intrinsics import fma_f32_exact

    rng = np.random.default_rng(2)
    a = rng.standard_normal(512).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float32)
    c = (-(a.astype(np.float64) * b)).astype(np.float32)  # a*b + c cancels: only a fused product keeps the rest
    c[:256] = rng.standard_normal(256).astype(np.float32)
    out = cuda.device_array(512, np.float32)
    k.fma_values[4, 128](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), out)
    expected = np.array([fma_f32_exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


def test_warp_shuffles_reduce_and_exchange_within_each_warp():
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    sums, maxes, partners = (cuda.device_array(256, np.float32) for _ in range(3))
    lane_sums = cuda.device_array(256, np.int32)
    k.warp_reductions[2, 128](cuda.to_device(x), sums, maxes, lane_sums, partners)
    warps = x.reshape(-1, 32)
    np.testing.assert_allclose(
        sums.copy_to_host().reshape(-1, 32), warps.sum(axis=1, keepdims=True).repeat(32, 1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(maxes.copy_to_host().reshape(-1, 32), warps.max(axis=1, keepdims=True).repeat(32, 1))
    index_sums = np.arange(256).reshape(-1, 32).sum(axis=1, keepdims=True).repeat(32, 1)
    np.testing.assert_array_equal(lane_sums.copy_to_host().reshape(-1, 32), index_sums)
    np.testing.assert_array_equal(partners.copy_to_host(), x[np.arange(256) ^ 5])


def test_16_byte_loads_read_four_consecutive_words():
    words = np.random.default_rng(2).integers(0, 2**32, 4 * 300, dtype=np.uint32)
    out = cuda.device_array((256, 4), np.uint32)
    start = 8  # 32 bytes in: still 16-byte aligned
    k.load_words[2, 128](cuda.to_device(words), out, np.int64(start))
    np.testing.assert_array_equal(out.copy_to_host(), words[start : start + 1024].reshape(256, 4))


def mixed_launch(source, target, position) -> Launch:
    scalars = (np.float32(1.5), np.int64(-7), np.float16(0.25), True, np.int8(-3), np.uint16(9), 0.125)
    return Launch(k.mixed_arguments, (4, 3), (16, 16), (source, target, position, *scalars))


def test_a_raw_launch_equals_numbas_launch():
    source = cuda.to_device(np.random.default_rng(3).standard_normal((64, 40)).astype(np.float32))
    position = cuda.to_device(np.array([11], np.int32))
    eager, raw = cuda.device_array((64, 40), np.float32), cuda.device_array((64, 40), np.float32)
    mixed_launch(source, eager, position).run()
    RawLaunch(mixed_launch(source, raw, position))()
    cuda.synchronize()
    np.testing.assert_array_equal(raw.copy_to_host(), eager.copy_to_host())
    expected = -(source.copy_to_host() * 1.5 + (-7 + 11 + 0.25 - 3 + 9 + 0.125))
    np.testing.assert_allclose(eager.copy_to_host(), expected, rtol=1e-6)


def test_a_graph_replay_equals_numbas_launches():
    start = np.random.default_rng(4).standard_normal(64).astype(np.float32)
    eager_values, graph_values = cuda.to_device(start), cuda.to_device(start)
    eager_scalars, graph_scalars = DeviceScalars(("position",)), DeviceScalars(("position",))

    def launches(values, scalars):
        return [
            Launch(k.add_at_position, 1, 1, (values, scalars["position"], np.float32(1.0))),
            Launch(k.scale_all, 1, 64, (values, np.float32(0.5))),
            Launch(k.add_at_position, 1, 1, (values, scalars["position"], np.float32(-2.0))),
        ]

    stream = cuda.stream()
    graph = LaunchGraph.capture(launches(graph_values, graph_scalars), stream)
    for position in (3, 3, 60, 0, 17):
        eager_scalars.set(position=position)
        eager_scalars.upload(stream)
        for launch in launches(eager_values, eager_scalars):
            launch.run(stream)
        graph_scalars.set(position=position)
        graph_scalars.upload(stream)
        graph.replay(stream)
        stream.synchronize()
    np.testing.assert_array_equal(graph_values.copy_to_host(), eager_values.copy_to_host())
    assert not np.array_equal(graph_values.copy_to_host(), start)
