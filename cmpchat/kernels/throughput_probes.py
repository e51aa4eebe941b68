"""Hardware probes behind `cmpchat doctor`: compute throughput of the paths the engine uses, memory and link
bandwidths, and whether GPUs can reach each other's memory (P2P). Every function measures the current GPU.

Compute probes run `CHAINS` independent chains of one instruction per thread, so the pipe and not the
instruction's latency sets the pace, on a grid of `BLOCKS_PER_SM` blocks per SM. The loops are `while`
loops: Numba's `range` adds a sign test per step, issue slots a GPU whose FP32 pipe issues every cycle
(Hopper) would take from the probed instruction. Each thread stores the sum of its chains, so no chain is
dead code, and the stored value has a closed form the tests check. Counting rule, per instruction: dp4a = 8
ops (4 multiplies + 4 adds), HFMA2 = 4 flops (2 lanes × multiply + add), FFMA = 2 flops. Times come from
CUDA events (`cudart.profile.time_launches`), with the iteration count calibrated so one launch runs about
`seconds_per_launch`: a throttled pipe can be 64× slower than a healthy one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, uint32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import dp4a, fma_f16x2, load_u32x4, unpack_f16x2
from cmpchat.cudart.launch import Launch
from cmpchat.cudart.profile import time_launches

CHAINS = 8
"""Independent accumulators per thread in the compute probes (the kernels spell out each one)."""
BLOCKS_PER_SM = 8
THREADS_PER_BLOCK = 256
OPS_PER_DP4A = 8
FLOPS_PER_HFMA2 = 4
FLOPS_PER_FFMA = 2
CALIBRATION_GROWTH = 16
MAX_ITERATIONS = 1 << 24


@kernel("void(int32[::1], int32, int32[::1])")
def dp4a_chains(inputs, iterations, out):
    """out[thread] = Σ_k (inputs[2] + k + iterations × dot4(inputs[0], inputs[1])), k < 8, in int32 arithmetic
    (dot4: the signed-byte dot product of two packed words)."""
    a, b, start = inputs[0], inputs[1], inputs[2]
    # int32 throughout (Numba widens int32 + int to int64, which would put conversions in the loop)
    acc0, acc1, acc2, acc3 = start, int32(start + 1), int32(start + 2), int32(start + 3)
    acc4, acc5, acc6, acc7 = int32(start + 4), int32(start + 5), int32(start + 6), int32(start + 7)
    step = 0
    while step < iterations:
        acc0 = dp4a(a, b, acc0)
        acc1 = dp4a(a, b, acc1)
        acc2 = dp4a(a, b, acc2)
        acc3 = dp4a(a, b, acc3)
        acc4 = dp4a(a, b, acc4)
        acc5 = dp4a(a, b, acc5)
        acc6 = dp4a(a, b, acc6)
        acc7 = dp4a(a, b, acc7)
        step += 1
    i = cuda.grid(1)
    if i < out.size:
        out[i] = acc0 + acc1 + acc2 + acc3 + acc4 + acc5 + acc6 + acc7


@kernel("void(uint32[::1], int32, float32[::1])")
def hfma2_chains(inputs, iterations, out):
    """Eight chains acc = fma_f16x2(acc, inputs[0], inputs[1]) from acc = inputs[2], `iterations` steps each;
    out[thread] = Σ over chains and both fp16 lanes of acc, in fp32."""
    a, b, start = inputs[0], inputs[1], inputs[2]
    acc0 = acc1 = acc2 = acc3 = acc4 = acc5 = acc6 = acc7 = start
    step = 0
    while step < iterations:
        acc0 = fma_f16x2(acc0, a, b)
        acc1 = fma_f16x2(acc1, a, b)
        acc2 = fma_f16x2(acc2, a, b)
        acc3 = fma_f16x2(acc3, a, b)
        acc4 = fma_f16x2(acc4, a, b)
        acc5 = fma_f16x2(acc5, a, b)
        acc6 = fma_f16x2(acc6, a, b)
        acc7 = fma_f16x2(acc7, a, b)
        step += 1
    total = float32(0)
    for word in (acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7):
        low, high = unpack_f16x2(word)
        total += low + high
    i = cuda.grid(1)
    if i < out.size:
        out[i] = total


@kernel("void(float32[::1], int32, float32[::1])")
def ffma_chains(inputs, iterations, out):
    """Eight chains acc = fma(acc, inputs[0], inputs[1]) from acc = inputs[2] + k, `iterations` steps each;
    out[thread] = Σ of the chains."""
    a, b, start = inputs[0], inputs[1], inputs[2]
    acc0, acc1, acc2, acc3 = start, start + float32(1), start + float32(2), start + float32(3)
    acc4, acc5, acc6, acc7 = start + float32(4), start + float32(5), start + float32(6), start + float32(7)
    step = 0
    while step < iterations:
        acc0 = cuda.fma(acc0, a, b)
        acc1 = cuda.fma(acc1, a, b)
        acc2 = cuda.fma(acc2, a, b)
        acc3 = cuda.fma(acc3, a, b)
        acc4 = cuda.fma(acc4, a, b)
        acc5 = cuda.fma(acc5, a, b)
        acc6 = cuda.fma(acc6, a, b)
        acc7 = cuda.fma(acc7, a, b)
        step += 1
    i = cuda.grid(1)
    if i < out.size:
        out[i] = acc0 + acc1 + acc2 + acc3 + acc4 + acc5 + acc6 + acc7


@dataclass(frozen=True)
class ComputeProbe:
    """A chain kernel with the inputs it runs on and the ops one chain step counts."""

    dispatcher: object
    inputs: np.ndarray
    out_dtype: type
    ops_per_step: int


# Values that stay finite for any iteration count: dp4a adds 4 × 1 × 1 per step (int32 wraps harmlessly),
# the FMAs keep acc = 0.5 (0.5 × 0.5 + 0.25). The rate does not depend on the values.
DP4A_PROBE = ComputeProbe(dp4a_chains, np.array([0x01010101, 0x01010101, 0], np.int32), np.int32, OPS_PER_DP4A)
HFMA2_PROBE = ComputeProbe(
    hfma2_chains, np.array([0x38003800, 0x34003400, 0x38003800], np.uint32), np.float32, FLOPS_PER_HFMA2
)  # fp16 0.5 = 0x3800, 0.25 = 0x3400, in both lanes
FFMA_PROBE = ComputeProbe(ffma_chains, np.array([0.5, 0.25, 0.5], np.float32), np.float32, FLOPS_PER_FFMA)


def probe_grid() -> tuple[int, int]:
    """(blocks, threads per block) that fill the current GPU: several resident blocks on every SM."""
    return cuda.get_current_device().MULTIPROCESSOR_COUNT * BLOCKS_PER_SM, THREADS_PER_BLOCK


def calibrated_rate(
    launch_for: Callable[[int], Launch], ops_per_iteration: float, seconds_per_launch: float, repeats: int
) -> float:
    """Ops/s of `launch_for(iterations)` (a launch doing `ops_per_iteration` ops per iteration), with as many
    iterations as make one launch take about `seconds_per_launch`.

    The count grows from 1 until a launch takes a quarter of that, then scales to it: starting higher would
    keep a 64×-throttled pipe busy for seconds per launch.
    """
    iterations = 1
    seconds = time_launches(launch_for(iterations), repeats=1, warmup=1)
    while seconds < seconds_per_launch / 4 and iterations < MAX_ITERATIONS:
        iterations = min(MAX_ITERATIONS, iterations * CALIBRATION_GROWTH)
        seconds = time_launches(launch_for(iterations), repeats=1, warmup=0)
    iterations = int(np.clip(iterations * seconds_per_launch / seconds, 1, MAX_ITERATIONS))
    seconds = time_launches(launch_for(iterations), repeats=repeats, warmup=1)
    return ops_per_iteration * iterations / seconds


def compute_rate(probe: ComputeProbe, seconds_per_launch: float = 0.005, repeats: int = 10) -> float:
    """Ops/s of the probe's instruction on the current GPU (see the module docstring for the counting)."""
    blocks, threads = probe_grid()
    inputs = cuda.to_device(probe.inputs)
    out = cuda.device_array(blocks * threads, probe.out_dtype)

    def launch_for(iterations: int) -> Launch:
        return Launch(probe.dispatcher, blocks, threads, (inputs, np.int32(iterations), out))

    ops_per_iteration = blocks * threads * CHAINS * probe.ops_per_step
    return calibrated_rate(launch_for, ops_per_iteration, seconds_per_launch, repeats)


@kernel("void(uint32[::1], uint32[::1])")
def read_stream(words, sink):
    """The streaming-read probe: read every word once with 16-byte loads (grid-stride); one xor per thread keeps the loads alive."""
    acc = uint32(0)
    start = 4 * (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
    stride = 4 * cuda.gridDim.x * cuda.blockDim.x
    for i in range(start, words.shape[0], stride):
        a, b, c, d = load_u32x4(words, i)
        acc ^= a ^ b ^ c ^ d
    if acc == uint32(0x9E3779B9):  # practically never: the store only defeats dead-code elimination
        sink[0] = acc


def streaming_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes/s the current GPU streams from its memory with 16-byte loads: the decode denominator.

    `read_stream` on uninitialised memory: filling 1 GiB from the host would
    take 5 s over a CMP's PCIe Gen1 x1 link, and the values do not matter (the H200 reads both at 4.57 TB/s).
    """
    words = cuda.device_array(nbytes // 16 * 4, np.uint32)
    sink = cuda.device_array(1, np.uint32)
    blocks, threads = probe_grid()
    seconds = time_launches(Launch(read_stream, blocks, threads, (words, sink)), repeats, warmup=3)
    return words.nbytes / seconds


def _events_seconds(copy: Callable[[object], None], repeats: int) -> float:
    """Seconds per `copy(stream)`, from CUDA events around `repeats` calls after one warm-up call."""
    stream = cuda.stream()
    copy(stream)
    start, stop = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(repeats):
        copy(stream)
    stop.record(stream)
    stop.synchronize()
    return cuda.event_elapsed_time(start, stop) / 1e3 / repeats


def device_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (cuMemcpyDtoD) of `nbytes`, counting read + write: 2 × nbytes per
    copy, so it compares with `streaming_read_bandwidth` (the H200: copy 4.25 TB/s, read 4.57 TB/s)."""
    source = cuda.device_array(nbytes, np.uint8)
    target = cuda.device_array(nbytes, np.uint8)
    seconds = _events_seconds(lambda stream: target.copy_to_device(source, stream=stream), repeats)
    return 2 * nbytes / seconds


def host_link_bandwidth(nbytes: int = 256 << 20, repeats: int = 2) -> tuple[float, float]:
    """(host → device, device → host) bytes/s of copies between pinned host memory and the current GPU."""
    host = cuda.pinned_array(nbytes, np.uint8)
    device = cuda.device_array(nbytes, np.uint8)
    to_device = _events_seconds(lambda stream: device.copy_to_device(host, stream=stream), repeats)
    to_host = _events_seconds(lambda stream: device.copy_to_host(host, stream=stream), repeats)
    return nbytes / to_device, nbytes / to_host


def peer_access(peers: list[int]) -> dict[int, bool]:
    """For each other GPU index in `peers`: whether the current GPU can map its memory (cuDeviceCanAccessPeer)."""
    context = cuda.current_context()
    return {peer: bool(context.can_access_peer(peer)) for peer in peers if peer != context.device.id}
