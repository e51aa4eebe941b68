"""The hand-off of hidden states from one pipeline stage to the next: device -> pinned host -> device, never P2P.

The cards this is for (CMP 100-210) have no peer-to-peer access, so every hop goes through host memory, as fp32,
so that a pipeline's logits equal one stage's bit for bit. The ordering must hold without P2P, and a stream's wait
on an event of another device does not make a pinned host buffer safe for that device's copy to read (engines
that relied on it read stale bytes and decoded garbage). So the host itself waits: for the device -> host copy's
own event before it queues the host -> device copy, and, before a buffer is written again, for the consumer's copy
out of it. Host buffers are used in turn, so a producer may hand on the next payloads while the consumer's copies
of earlier ones are still queued (a pipelined prompt's chunks).

`HostBridge` copies on the streams it is given; `OverlappedHandOff` runs a pipelined prompt's hand-offs on copy
streams of the stages (the producer's departure stream, the consumer's arrival stream), through staging buffers,
so a hop's copies overlap both stages' compute.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
    """Hands fp32 device arrays of up to `values` elements from a producer's stream to a consumer's, through
    `buffers` pinned host buffers (at most that many hand-offs taken and not yet delivered)."""

    def __init__(
        self, producer: tuple[OnDevice, Any], consumer: tuple[OnDevice, Any], values: int, buffers: int = 2
    ) -> None:
        """`producer` and `consumer`: (a context manager factory that makes the side's GPU current, its stream)."""
        (self._producer_device, self._producer_stream), (self._consumer_device, self._consumer_stream) = (
            producer,
            consumer,
        )
        self.host = cuda.pinned_array((buffers, values), np.float32)
        with self._producer_device():
            self._written = [ordering_event() for _ in range(buffers)]
        with self._consumer_device():
            self._read = [ordering_event() for _ in range(buffers)]
        self._read_pending = [False] * buffers
        self._next = 0
        self._taken: deque[tuple[int, int]] = deque()
        """(host buffer, values) of each hand-off taken and not yet delivered, oldest first."""
        self.handoffs = 0
        self.bytes = 0
        """Hand-offs and bytes sent so far (the benchmark reports bridge bytes per token)."""

    def take(self, source: Any) -> None:
        """Queue `source`'s copy (a contiguous fp32 array on the producer's GPU) into the next host buffer behind
        the producer's work (returns at once, unless the consumer has not yet copied out of that buffer what it
        last held). `deliver` sends the oldest taken on, later: a pipeline takes a stage's output before the next
        stage is ready for it."""
        if source.size > self.host.shape[1]:
            raise ValueError(f"cannot hand {source.size} values through a {self.host.shape[1]} buffer")
        if len(self._taken) == len(self.host):
            raise RuntimeError(f"{len(self.host)} hand-offs were taken and not delivered")
        turn = self._next
        host = self.host[turn, : source.size]
        if self._read_pending[turn]:
            self._read[turn].synchronize()  # the consumer's copy out of this buffer is done
        with self._producer_device():
            _device_to_host(source, host, self._producer_stream)
            self._written[turn].record(self._producer_stream)
        self._taken.append((turn, source.size))
        self._next = (turn + 1) % len(self.host)

    def ready(self) -> bool:
        """Whether the oldest taken bytes are in host memory already (so `deliver` would not wait)."""
        if not self._taken:
            raise RuntimeError("nothing was taken to deliver")
        return SIMULATOR or bool(self._written[self._taken[0][0]].query())  # the simulator runs copies at once

    def deliver(self, target: Any) -> None:
        """Wait until the oldest taken bytes are in host memory, then queue their copy into `target` (the
        consumer's, as large as what was taken) behind the consumer's work."""
        if not self._taken:
            raise RuntimeError("nothing was taken to deliver")
        turn, size = self._taken[0]
        if target.size != size:
            raise ValueError(f"cannot hand {size} values to {target.size}")
        host = self.host[turn, :size]
        self._written[turn].synchronize()  # the bytes are in host memory: only now may the consumer copy them
        with self._consumer_device():
            _host_to_device(host, target, self._consumer_stream)
            self._read[turn].record(self._consumer_stream)
        self._read_pending[turn] = True
        self._taken.popleft()
        self.handoffs += 1
        self.bytes += 4 * size


@dataclass(frozen=True)
class HandOffSide:
    """One stage as an end of an overlapped hand-off."""

    on_device: OnDevice
    stream: Any
    """The stage's compute stream: its steps read and write `hidden` there."""
    copy_stream: Any
    """Where this side's copies run: the producer's departure stream, the consumer's arrival stream."""
    hidden: Any
    """The step's hidden states (fp32, contiguous)."""
    staging: Any
    """A buffer the size of `hidden` that the copies read from (producer) or write into (consumer)."""


class OverlappedHandOff:
    """A pipelined prompt's hand-offs from one stage to the next, beside the stages' steps. The producer's step
    stream copies `hidden` into its staging buffer (on the device: microseconds) and goes on to its next chunk
    while its departure stream moves the staged bytes to the host; the consumer's arrival stream moves them into
    its staging buffer while its step stream still computes the previous chunk, and the step stream copies them
    into `hidden` just before the step that reads them. Each stream waits only on events of its own GPU; the
    host waits for the bytes in host memory (`HostBridge`). Three host buffers: the producer may run two chunks
    ahead of the consumer's copy without waiting."""

    HOST_BUFFERS = 3

    def __init__(self, producer: HandOffSide, consumer: HandOffSide) -> None:
        if producer.hidden.size != consumer.hidden.size:
            raise ValueError(f"cannot hand {producer.hidden.size} values to {consumer.hidden.size}")
        self._producer, self._consumer = producer, consumer
        self.bridge = HostBridge(
            (producer.on_device, producer.copy_stream),
            (consumer.on_device, consumer.copy_stream),
            producer.hidden.size,
            self.HOST_BUFFERS,
        )
        with producer.on_device():
            self._staged, self._downloaded = ordering_event(), ordering_event()
        with consumer.on_device():
            self._arrived, self._consumed = ordering_event(), ordering_event()

    def send(self) -> None:
        """Hand on what the producer's last queued step leaves in `hidden` (call with its GPU current)."""
        p = self._producer
        self._downloaded.wait(p.stream)  # the staging buffer's last download is done
        p.staging.copy_to_device(p.hidden, stream=p.stream)
        self._staged.record(p.stream)
        self._staged.wait(p.copy_stream)
        self.bridge.take(p.staging.reshape(-1))
        self._downloaded.record(p.copy_stream)

    def receive(self) -> None:
        """Put the oldest payload sent into the consumer's `hidden` before its next queued step (the host waits
        until the bytes are in host memory; call with the consumer's GPU current)."""
        c = self._consumer
        self._consumed.wait(c.copy_stream)  # the staging buffer's last payload was copied into `hidden`
        self.bridge.deliver(c.staging.reshape(-1))
        self._arrived.record(c.copy_stream)
        self._arrived.wait(c.stream)
        c.hidden.copy_to_device(c.staging, stream=c.stream)
        self._consumed.record(c.stream)


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
