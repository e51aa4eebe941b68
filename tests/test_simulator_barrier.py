"""The simulator barrier conftest.py installs keeps the simulator's semantics (tests/simulator_barrier.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from numba import cuda, float32

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="simulator only")


def test_it_is_installed():
    from numba.cuda.simulator import kernel as simulator

    from tests.simulator_barrier import _run_block

    assert simulator.BlockManager.run is _run_block


@cuda.jit
def _reverse_with_early_exits(values, out):
    shared = cuda.shared.array(64, float32)
    i = cuda.threadIdx.x
    if i >= 48:
        return  # threads that finish count out of every later barrier
    shared[i] = values[i]
    cuda.syncthreads()
    out[i] = shared[47 - i]
    cuda.syncthreads()
    shared[i] = out[i] * 2
    cuda.syncthreads()
    out[i] = shared[47 - i]


def test_barriers_wait_for_every_running_thread():
    values = np.arange(64, dtype=np.float32)
    out = np.zeros(64, np.float32)
    _reverse_with_early_exits[2, 64](values, out)
    np.testing.assert_array_equal(out[:48], 2 * values[:48])
    assert not out[48:].any()


@cuda.jit
def _fails_in_one_thread(out):
    i = cuda.threadIdx.x
    cuda.syncthreads()
    if i == 5:
        out[100] = 1  # out of bounds
    cuda.syncthreads()
    out[i] = i


def test_a_failing_thread_aborts_the_block_with_its_own_error():
    with pytest.raises(IndexError, match="tid=\\[5, 0, 0\\]"):
        _fails_in_one_thread[1, 32](np.zeros(32, np.float32))
