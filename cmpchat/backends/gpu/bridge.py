"""The hand-off of hidden states from one pipeline stage to the next: device -> pinned host -> device, never P2P.

The cards this is for (CMP 100-210) have no peer-to-peer access, so every hop goes through host memory, as fp32,
so that a pipeline's logits equal one stage's bit for bit. The ordering must hold without P2P, and a stream's wait
on an event of another device does not make a pinned host buffer safe for that device's copy to read (engines
that relied on it read stale bytes and decoded garbage). So the host itself waits: for the device -> host copy's
own event before it queues the host -> device copy, and, before a buffer is written again, for the consumer's copy
out of it. Two buffers in turn let the producer's next hand-off start while the consumer's copy of the last one
is still queued (consecutive prompt chunks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.gpu.buffers import ordering_event
from cmpchat.cudart.driver_api import check, stream_handle
from cmpchat.cudart.intrinsics import SIMULATOR

if not SIMULATOR:
    from cuda.bindings import driver

OnDevice = Callable[[], contextlib.AbstractContextManager[None]]


class HostBridge:
    """Hands fp32 device arrays of up to `values` elements from a producer's stream to a consumer's."""

    def __init__(self, producer: tuple[OnDevice, Any], consumer: tuple[OnDevice, Any], values: int) -> None:
        """`producer` and `consumer`: (a context manager factory that makes the side's GPU current, its stream)."""
        (self._producer_device, self._producer_stream), (self._consumer_device, self._consumer_stream) = (
            producer,
            consumer,
        )
        self.host = cuda.pinned_array((2, values), np.float32)
        with self._producer_device():
            self._written = [ordering_event() for _ in range(2)]
        with self._consumer_device():
            self._read = [ordering_event() for _ in range(2)]
        self._read_pending = [False, False]
        self._turn = 0
        self._taken: int | None = None
        """Values taken into the current buffer and not yet delivered."""
        self.handoffs = 0
        self.bytes = 0
        """Hand-offs and bytes sent so far (the benchmark reports bridge bytes per token)."""

    def send(self, source: Any, target: Any) -> None:
        """Queue the copy of `source` (a contiguous fp32 array on the producer's GPU) into `target` (one of the
        same size on the consumer's): returns once the bytes are in host memory and the upload is queued."""
        if target.size != source.size:
            raise ValueError(f"cannot hand {source.size} values to {target.size}")
        self.take(source)
        self.deliver(target)

    def take(self, source: Any) -> None:
        """Queue `source`'s copy into the next host buffer behind the producer's work (returns at once, unless
        the consumer has not yet copied out of that buffer what it held two hand-offs ago). `deliver` sends it
        on; a pipelined prefill takes every stage's output, then delivers them, so no stage waits for another's."""
        if source.size > self.host.shape[1]:
            raise ValueError(f"cannot hand {source.size} values through a {self.host.shape[1]} buffer")
        if self._taken is not None:
            raise RuntimeError("a hand-off was taken and not delivered")
        turn = self._turn
        host = self.host[turn, : source.size]
        if self._read_pending[turn]:
            self._read[turn].synchronize()  # the consumer's copy out of this buffer, two hand-offs ago, is done
        with self._producer_device():
            _device_to_host(source, host, self._producer_stream)
            self._written[turn].record(self._producer_stream)
        self._taken = source.size

    def deliver(self, target: Any) -> None:
        """Wait until the taken bytes are in host memory, then queue their copy into `target` (the consumer's,
        as large as what was taken) behind the consumer's work."""
        size, turn = self._taken, self._turn
        if size is None:
            raise RuntimeError("nothing was taken to deliver")
        if target.size != size:
            raise ValueError(f"cannot hand {size} values to {target.size}")
        host = self.host[turn, :size]
        self._written[turn].synchronize()  # the bytes are in host memory: only now may the consumer copy them
        with self._consumer_device():
            _host_to_device(host, target, self._consumer_stream)
            self._read[turn].record(self._consumer_stream)
        self._read_pending[turn] = True
        self._taken = None
        self._turn = 1 - turn
        self.handoffs += 1
        self.bytes += 4 * size


def _device_to_host(source: Any, host: np.ndarray, stream: Any) -> None:
    if SIMULATOR:
        host[:] = source.copy_to_host(stream=stream).reshape(-1)
        return
    _require_contiguous(source)
    result = driver.cuMemcpyDtoHAsync(
        host.ctypes.data, source.device_ctypes_pointer.value, source.nbytes, stream_handle(stream)
    )
    check("cuMemcpyDtoHAsync", result)


def _host_to_device(host: np.ndarray, target: Any, stream: Any) -> None:
    if SIMULATOR:
        target.copy_to_device(host.reshape(target.shape), stream=stream)
        return
    _require_contiguous(target)
    result = driver.cuMemcpyHtoDAsync(
        target.device_ctypes_pointer.value, host.ctypes.data, target.nbytes, stream_handle(stream)
    )
    check("cuMemcpyHtoDAsync", result)


def _require_contiguous(array: Any) -> None:
    if not array.is_c_contiguous():
        raise ValueError("the bridge copies contiguous arrays only")
