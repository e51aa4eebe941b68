"""The Gated DeltaNet decode step on the GPU: its recurrent state's read and write against a device copy."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from cmpchat.bench.kernels.timing import timed_while_held
from cmpchat.cudart.launch import Launch
from cmpchat.kernels.gated_deltanet import GatedDeltaNetShape, GatedDeltaNetWeights, decode_step


def benchmark_decode_step(
    shape: GatedDeltaNetShape,
    batch: int,
    *,
    steps: int = 100,
    min_state_bytes: int = 256 << 20,
    hold_ns: int = 20_000_000,
    seed: int = 0,
) -> dict[str, float | bool]:
    """Time the decode step on the current GPU with CUDA events; returns microseconds and GB/s.

    Numba's own launch path costs ~20 us per launch, more than the kernels take, so the stream is held busy
    while the timed launches queue up behind it: the events then see GPU time only (`gpu_bound` says whether
    the queue stayed ahead; the hold grows and the timing is retried if not). The state is
    spread over enough copies (`min_state_bytes`, several times the L2) that every step reads DRAM.
    `state_gbps` counts the fp32 state read + written by the recurrent kernel; `copy_gbps` is a
    device-to-device copy of the same total size in the same run (read + write), the practical limit.
    """
    rng = np.random.default_rng(seed)
    stream = cuda.stream()
    per_layer = shape.delta_state_bytes(batch)
    copies = max(2, -(-min_state_bytes // per_layer))
    f32 = np.float32
    weights = GatedDeltaNetWeights(
        cuda.to_device((0.3 * rng.standard_normal((shape.conv_dim, shape.conv_kernel))).astype(f32)),
        cuda.to_device(-np.exp(rng.standard_normal(shape.num_v_heads)).astype(f32)),
        cuda.to_device(rng.standard_normal(shape.num_v_heads).astype(f32)),
        cuda.to_device((1.0 + 0.1 * rng.standard_normal(shape.v_head_dim)).astype(f32)),
    )
    projection = cuda.to_device(rng.standard_normal((batch, shape.projection_width)).astype(f32))
    mixed = cuda.device_array((batch, shape.conv_dim), f32)
    out = cuda.device_array((batch, shape.output_width), f32)
    slots = cuda.to_device(np.arange(batch, dtype=np.int32))
    conv_template = cuda.to_device(np.zeros((batch, shape.conv_kernel - 1, shape.conv_dim), f32))
    state_template = cuda.to_device(
        (0.05 * rng.standard_normal((batch, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim))).astype(f32)
    )
    steps_launches: list[list[Launch]] = []
    for _ in range(copies):
        conv_state = cuda.device_array_like(conv_template)
        conv_state.copy_to_device(conv_template)
        delta_state = cuda.device_array_like(state_template)
        delta_state.copy_to_device(state_template)  # device to device: no PCIe traffic
        steps_launches.append(list(decode_step(shape, weights, projection, conv_state, delta_state, slots, out, mixed)))

    def time_us(run_step: Any, repeats: int) -> tuple[float, bool]:
        run_step(0)  # compile and warm up
        hold = hold_ns
        for _attempt in range(3):  # a longer hold if the host fell behind the GPU
            seconds, queued_in_time = timed_while_held(lambda: [run_step(s) for s in range(repeats)], stream, hold)
            if queued_in_time:
                break
            hold *= 4
        return 1e6 * seconds / repeats, queued_in_time

    def launcher(which: slice) -> Any:
        def run_step(step: int) -> None:
            for launch in steps_launches[step % copies][which]:
                launch.run(stream)

        return run_step

    step_us, ok_step = time_us(launcher(slice(0, 2)), steps)
    conv_us, ok_conv = time_us(launcher(slice(0, 1)), steps)
    recurrent_us, ok_recurrent = time_us(launcher(slice(1, 2)), steps)

    copy_words = copies * per_layer // 4
    source, target = cuda.device_array(copy_words, f32), cuda.device_array(copy_words, f32)
    copy_us, ok_copy = time_us(lambda step: target.copy_to_device(source, stream=stream), 5)
    return {
        "batch": batch,
        "state_bytes_per_step": 2 * per_layer,
        "step_us": step_us,
        "conv_us": conv_us,
        "recurrent_us": recurrent_us,
        "state_gbps": 2 * per_layer / recurrent_us / 1e3,
        "copy_gbps": 2 * 4 * copy_words / copy_us / 1e3,
        "state_to_copy_ratio": (2 * per_layer / recurrent_us) / (2 * 4 * copy_words / copy_us),
        "gpu_bound": ok_step and ok_conv and ok_recurrent and ok_copy,
    }
