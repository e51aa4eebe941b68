"""Raw launches and CUDA graphs on a real GPU: strided arrays, dynamic shared memory above 48 KB, the driver's
parameter table, device scalars, capture errors, and launch overhead (recorded in the JUnit report)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from numba import cuda

from cmpchat.cudart import raw_launch
from cmpchat.cudart import selftest_kernels as k
from cmpchat.cudart.device_scalars import DeviceScalars
from cmpchat.cudart.driver_api import CudaDriverError
from cmpchat.cudart.graph import LaunchGraph
from cmpchat.cudart.kernel_args import kernel_params, pack_params
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.raw_launch import RawLaunch

pytestmark = pytest.mark.gpu


def test_strided_views_and_every_scalar_kind_pass_as_numba_passes_them():
    rng = np.random.default_rng(5)
    source = cuda.to_device(rng.standard_normal((33, 20)).astype(np.float32))
    position = cuda.to_device(np.array([-4], np.int32))
    wide_eager, wide_raw = (
        cuda.to_device(np.zeros((33, 60), np.float32)),
        cuda.to_device(np.zeros((33, 60), np.float32)),
    )
    eager, raw = wide_eager[:, 1::3], wide_raw[:, 1::3]  # any-layout views: strides (240, 12)
    scalars = (np.float32(-0.75), np.int64(2**40), np.float16(-1.5), False, np.int8(-128), np.uint16(65535), -1e-3)
    Launch(k.mixed_arguments, (3, 3), (16, 8), (source, eager, position, *scalars)).run()
    RawLaunch(Launch(k.mixed_arguments, (3, 3), (16, 8), (source, raw, position, *scalars)))()
    cuda.synchronize()
    np.testing.assert_array_equal(wide_raw.copy_to_host(), wide_eager.copy_to_host())
    assert np.count_nonzero(wide_raw.copy_to_host()[:, 0::3]) == 0  # nothing written between the strided columns


def test_the_driver_parameter_table_confirms_the_packing_offsets_included():
    source = cuda.to_device(np.zeros((4, 4), np.float32))
    target = cuda.device_array((4, 4), np.float32)
    position = cuda.to_device(np.zeros(1, np.int32))
    launch = mixed_launch_for_table(source, target, position)
    raw = RawLaunch(launch)
    # By the function, not the name: a kernel Numba loads from its disk cache has no Python name to match.
    bound = next(b for b in raw_launch._BOUND.values() if b.function is raw._function)
    assert bound.param_table is not None, "cuFuncGetParamInfo unavailable: layouts go unchecked"
    argtypes = [k.mixed_arguments.typeof_pyval(value) for value in launch.args]
    packed = pack_params(kernel_params(argtypes, launch.args))
    assert tuple((offset, p.size) for offset, p in zip(packed.offsets, packed.params)) == bound.param_table


def mixed_launch_for_table(source, target, position) -> Launch:
    scalars = (np.float32(1.0), np.int64(1), np.float16(1.0), True, np.int8(1), np.uint16(1), 1.0)
    return Launch(k.mixed_arguments, 1, (4, 4), (source, target, position, *scalars))


def test_dynamic_shared_memory_above_48_kb():
    n = 24 * 1024  # 96 KB of float32: the CMP's per-block maximum
    source = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    target = cuda.device_array(n, np.float32)
    RawLaunch(Launch(k.reverse_in_shared, 1, 1024, (cuda.to_device(source), target), shared_bytes=4 * n))()
    np.testing.assert_array_equal(target.copy_to_host(), source[::-1])


def test_device_scalars_upload_through_the_driver():
    scalars = DeviceScalars(("position", "length", "token"))
    stream = cuda.stream()
    scalars.set(position=41, length=42, token=-1)
    scalars.upload(stream)
    stream.synchronize()
    np.testing.assert_array_equal(scalars.device.copy_to_host(), [41, 42, -1])
    assert scalars["length"].copy_to_host().tolist() == [42]


def test_every_node_of_a_large_graph_runs_on_every_replay():
    counter = cuda.to_device(np.zeros(1, np.int32))
    stream = cuda.stream()
    graph = LaunchGraph.capture([Launch(k.count_launch, 1, 32, (counter,))] * 200, stream)
    for _ in range(10):
        graph.replay()
    stream.synchronize()
    assert counter.copy_to_host()[0] == 2000
    graph.close()
    with pytest.raises(CudaDriverError):
        graph.replay()


def test_capture_refuses_the_default_stream():
    counter = cuda.to_device(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="created stream"):
        LaunchGraph.capture([Launch(k.count_launch, 1, 32, (counter,))], 0)


def test_a_failed_launch_ends_the_capture_and_the_stream_stays_usable():
    counter = cuda.to_device(np.zeros(1, np.int32))
    stream = cuda.stream()
    too_large_block = Launch(k.count_launch, 1, 4096, (counter,))
    with pytest.raises(CudaDriverError, match="cuLaunchKernel"):
        LaunchGraph.capture([Launch(k.count_launch, 1, 32, (counter,)), too_large_block], stream)
    graph = LaunchGraph.capture([Launch(k.count_launch, 1, 32, (counter,))], stream)
    graph.replay()
    stream.synchronize()
    assert counter.copy_to_host()[0] == 1


def per_launch_microseconds(run, launches: int) -> float:
    run()  # warm: compilation, module load, first-launch costs
    cuda.synchronize()
    start = time.perf_counter()
    run()
    cuda.synchronize()
    return (time.perf_counter() - start) / launches * 1e6


def test_launch_overhead_eager_raw_and_graph(record_property):
    """Host time per launch of a near-empty kernel; docs/hardware.md expects about 20, 5 and 1 µs."""
    count = 500
    counter = cuda.to_device(np.zeros(1, np.int32))
    stream = cuda.stream()
    launch = Launch(k.count_launch, 1, 32, (counter,))
    raw = RawLaunch(launch)
    graph = LaunchGraph.capture([launch] * count, stream)

    def eager():
        for _ in range(count):
            launch.run(stream)

    def raw_launches():
        for _ in range(count):
            raw(stream)

    timings = {
        "eager_us_per_launch": per_launch_microseconds(eager, count),
        "raw_us_per_launch": per_launch_microseconds(raw_launches, count),
        "graph_us_per_launch": per_launch_microseconds(graph.replay, count),
    }
    for name, value in timings.items():
        record_property(name, round(value, 3))
    print(timings)
    assert counter.copy_to_host()[0] == 6 * count
    assert timings["graph_us_per_launch"] < timings["eager_us_per_launch"]
    assert timings["raw_us_per_launch"] < timings["eager_us_per_launch"]


def test_cost_in_replay_tells_a_heavy_group_from_a_light_one():
    from cmpchat.cudart.profile import cost_in_replay

    values = cuda.to_device(np.ones(1 << 24, np.float32))  # 64 MB: each pass is a read and a write from memory
    counter = cuda.to_device(np.zeros(1, np.int32))
    heavy = Launch(k.scale_all, (1 << 24) // 256, 256, (values, np.float32(1.0)))
    light = Launch(k.count_launch, 1, 32, (counter,))
    stream = cuda.stream()
    launches = [heavy, light] * 20
    for launch in launches:
        launch.run(stream)  # compiled before the captures
    stream.synchronize()
    costs = cost_in_replay(launches, stream, lambda name: "heavy" if name.startswith("scale") else "light")
    assert set(costs) == {"heavy", "light"}
    # 20 passes over 128 MB take at least 0.2 ms on any GPU this runs on; 20 one-warp launches in a graph add little.
    assert costs["heavy"] > 2e-4 and costs["light"] < costs["heavy"] / 5
