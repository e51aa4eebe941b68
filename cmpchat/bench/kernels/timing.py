"""GPU time of queued work by CUDA events, with the stream held busy while the work is queued, so Numba's
per-launch host cost (12-50 µs, more than many kernels take) stays out of the figure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda


@cuda.jit("void(int64)")
def hold_stream(nanoseconds):
    """Keep the GPU busy for about `nanoseconds` while the host queues the launches to time."""
    for _ in range(nanoseconds // 1000):
        cuda.nanosleep(1000)


def seconds_per_call(work: Callable[[], Any], repeats: int, warmup: int = 3, stream: Any = None) -> float:
    """GPU seconds of one `work()` (which queues on `stream`, default the default stream), averaged over
    `repeats`; the stream is held busy for 200 µs a call while they are queued."""
    for _ in range(warmup):
        work()
    stream = stream or cuda.default_stream()
    start, end = cuda.event(), cuda.event()
    hold_stream[1, 1, stream](np.int64(repeats * 200_000))
    start.record(stream)
    for _ in range(repeats):
        work()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3 / repeats


def timed_while_held(run: Callable[[], Any], stream: Any, hold_ns: int) -> tuple[float, bool]:
    """GPU seconds of `run()` (queuing on `stream`) behind a hold of `hold_ns`, and whether all of it was
    queued before the hold ended (else the figure includes host time and should be taken again)."""
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    hold_stream[1, 1, stream](np.int64(hold_ns))
    start.record(stream)
    run()
    end.record(stream)
    queued_in_time = not start.query()
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3, queued_in_time
