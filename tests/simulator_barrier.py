"""A faster `syncthreads` for Numba's CUDA simulator, installed by conftest.py when the tests run simulated.

The simulator runs each CUDA thread of a block as a Python thread; its block manager finds out that all of
them reached a barrier by polling every thread in a loop, holding the GIL while the threads wait for it.
Our kernels' simulated warp shuffles are block barriers (`intrinsics.shfl_xor_f32`), so a reduction-heavy
kernel spends most of its simulated time there (a tiny-model GEMV launch: 37 s polled, 7 s here). This
barrier is event-driven: the last thread to arrive, or to finish, releases the others. The semantics are the
simulator's: a barrier waits for every thread of the block that is still running; a thread that raises
aborts the block and its exception is the one re-raised.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numba.cuda.simulator import kernel as simulator


class BlockBarrier:
    def __init__(self, threads: int) -> None:
        self._condition = threading.Condition()
        self._running = threads
        self._waiting = 0
        self._generation = 0
        self.failed: Any = None  # the first thread that raised

    def wait(self) -> None:
        with self._condition:
            self._check()
            generation = self._generation
            self._waiting += 1
            if self._waiting == self._running:
                self._release()
            while generation == self._generation and self.failed is None:
                self._condition.wait()
            self._check()

    def finished(self) -> None:
        with self._condition:
            self._running -= 1
            if self._running and self._waiting == self._running:
                self._release()

    def fail(self, thread: Any) -> None:
        with self._condition:
            if self.failed is None:
                self.failed = thread
            self._condition.notify_all()

    def _check(self) -> None:
        if self.failed is not None:
            raise RuntimeError("abort flag set on syncthreads call")

    def _release(self) -> None:
        self._waiting = 0
        self._generation += 1
        self._condition.notify_all()


def _syncthreads(self: Any) -> None:
    self.block_barrier.wait()


def _run_block(self: Any, grid_point: tuple[int, ...], *args: Any) -> None:
    points = list(np.ndindex(*self._block_dim))
    barrier = BlockBarrier(len(points))
    threads = []
    for point in points:

        def target() -> None:
            try:
                self._f(*args)
            except BaseException:
                barrier.fail(threading.current_thread())
                raise
            finally:
                barrier.finished()

        thread = simulator.BlockThread(target, self, grid_point, point, self._debug)
        thread.block_barrier = barrier
        threads.append(thread)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if barrier.failed is not None:
        error, traceback = barrier.failed.exception
        raise error.with_traceback(traceback)


def install() -> bool:
    """Replace the simulator's polling barrier; False (and nothing changed) if its internals are not the
    ones this was written against (numba-cuda 0.30)."""
    manager, thread = simulator.BlockManager, simulator.BlockThread
    if not (
        hasattr(manager, "run")
        and hasattr(thread, "syncthreads")
        and "_block_dim" in manager.__init__.__code__.co_names
    ):
        return False
    thread.syncthreads = _syncthreads
    manager.run = _run_block
    return True
