"""The host bridge between pipeline stages: many thousand hand-offs of random payloads, every byte checked.

On the GPU the producer and the consumer are two streams (as two stages on one GPU are), so a hand-off whose
ordering were wrong would let the consumer read a buffer the producer has not finished writing, or the producer
overwrite one the consumer has not read yet. The consumer copies each arrival aside on its own stream; nothing
waits between hand-offs except what the bridge itself waits for, and only at the end are all arrivals compared.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.gpu.bridge import HandOffSide, HostBridge, OverlappedHandOff


def hand_off_many(handoffs: int, width: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    producer_stream, consumer_stream = cuda.stream(), cuda.stream()
    here = contextlib.nullcontext
    bridge = HostBridge((here, producer_stream), (here, consumer_stream), width)
    payloads = cuda.pinned_array((handoffs, width), np.float32)
    payloads[:] = rng.standard_normal((handoffs, width), dtype=np.float32)
    source, target = cuda.device_array(width, np.float32), cuda.device_array(width, np.float32)
    arrived = cuda.device_array((handoffs, width), np.float32)
    for i in range(handoffs):
        size = int(rng.integers(1, width + 1))  # hidden states of 1 to 256 rows differ in size
        source[:size].copy_to_device(payloads[i, :size], stream=producer_stream)
        bridge.take(source[:size])
        bridge.deliver(target[:size])
        arrived[i, :size].copy_to_device(target[:size], stream=consumer_stream)
        payloads[i, size:] = 0
        arrived[i, size:].copy_to_device(payloads[i, size:], stream=consumer_stream)
    consumer_stream.synchronize()
    got = arrived.copy_to_host()
    wrong = np.flatnonzero((got.view(np.uint32) != payloads.view(np.uint32)).any(axis=1))
    assert wrong.size == 0, f"{wrong.size} of {handoffs} hand-offs arrived wrong, the first at {wrong[:1]}"
    assert bridge.handoffs == handoffs


def test_ten_thousand_hand_offs_arrive_byte_for_byte():
    hand_off_many(10_000, 16)


def test_a_payload_larger_than_the_bridge_is_refused():
    here = contextlib.nullcontext
    bridge = HostBridge((here, cuda.stream()), (here, cuda.stream()), 4)
    with pytest.raises(ValueError, match="cannot hand 8 values"):
        bridge.take(cuda.device_array(8, np.float32))
    with pytest.raises(RuntimeError, match="nothing was taken"):
        bridge.deliver(cuda.device_array(4, np.float32))
    bridge.take(cuda.device_array(4, np.float32))
    with pytest.raises(ValueError, match="cannot hand 4 values to 3"):
        bridge.deliver(cuda.device_array(3, np.float32))


def overlapped_hand_offs(chunks: int, width: int, seed: int = 0) -> None:
    """As a pipelined prompt runs them: the producer queues chunk i + 1 (and sends it) before the consumer
    receives chunk i; the producer's next 'step' overwrites its hidden states right after each send, and the
    consumer's reads its own right after each receive, on their compute streams."""
    rng = np.random.default_rng(seed)
    here = contextlib.nullcontext

    def side() -> HandOffSide:
        return HandOffSide(here, cuda.stream(), cuda.stream(), cuda.device_array((2, width), np.float32),
                           cuda.device_array((2, width), np.float32))  # fmt: skip

    producer, consumer = side(), side()
    hand_off = OverlappedHandOff(producer, consumer)
    payloads = cuda.pinned_array((chunks, 2, width), np.float32)
    payloads[:] = rng.standard_normal(payloads.shape, dtype=np.float32)
    arrived = cuda.device_array((chunks, 2, width), np.float32)
    for i in range(chunks + 1):
        if i < chunks:
            producer.hidden.copy_to_device(payloads[i], stream=producer.stream)  # the step writing chunk i
            hand_off.send()
        if i > 0:
            hand_off.receive()
            arrived[i - 1].copy_to_device(consumer.hidden, stream=consumer.stream)  # the step reading chunk i - 1
    consumer.stream.synchronize()
    got = arrived.copy_to_host()
    wrong = np.flatnonzero((got.view(np.uint32) != payloads.view(np.uint32)).reshape(chunks, -1).any(axis=1))
    assert wrong.size == 0, f"{wrong.size} of {chunks} chunks arrived wrong, the first at {wrong[:1]}"
    assert hand_off.bridge.handoffs == chunks


def test_overlapped_hand_offs_of_a_pipelined_prompt_arrive_in_order_byte_for_byte():
    overlapped_hand_offs(50, 8)


def test_an_overlapped_hand_off_needs_equal_sides_and_a_bridge_holds_its_buffers_count():
    here = contextlib.nullcontext
    small, large = (HandOffSide(here, cuda.stream(), cuda.stream(), cuda.device_array(n, np.float32),
                                cuda.device_array(n, np.float32)) for n in (4, 8))  # fmt: skip
    with pytest.raises(ValueError, match="cannot hand 4 values to 8"):
        OverlappedHandOff(small, large)
    bridge = HostBridge((here, cuda.stream()), (here, cuda.stream()), 4, buffers=2)
    bridge.take(cuda.device_array(4, np.float32))
    bridge.take(cuda.device_array(4, np.float32))
    with pytest.raises(RuntimeError, match="2 hand-offs were taken and not delivered"):
        bridge.take(cuda.device_array(4, np.float32))


@pytest.mark.gpu
def test_ten_thousand_hand_offs_of_27b_hidden_states_arrive_byte_for_byte_on_the_gpu():
    hand_off_many(10_000, 5120)


@pytest.mark.gpu
def test_overlapped_hand_offs_of_128_row_27b_chunks_arrive_byte_for_byte_on_the_gpu():
    overlapped_hand_offs(500, 128 * 5120 // 2)
