"""Small helpers for device arrays the GPU backend allocates: zeroed buffers, views, ordering events."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from cmpchat.cudart.intrinsics import SIMULATOR


def zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
    array = cuda.device_array(shape, dtype)
    fill_zero(array)
    return array


def fill_zero(array: Any, stream: Any = None) -> None:
    """Zero a contiguous device array on the device (no host-side buffer: states can be 100s of MB); queued on
    `stream` when given."""
    if SIMULATOR:
        array[...] = 0
    else:
        from numba.cuda.cudadrv import driver

        driver.device_memset(array, 0, array.nbytes, stream=stream or 0)


def columns(buffer: Any, rows: int, width: int) -> Any:
    """A contiguous [rows, width] view at the start of a [R, wider] buffer (rows of `width`, packed)."""
    flat = buffer.reshape(-1)
    return flat[: rows * width].reshape(rows, width)


def ordering_event() -> Any:
    """A CUDA event for waiting on (no timing, so recording it costs the least; the simulator's takes no
    options)."""
    return cuda.event() if SIMULATOR else cuda.event(timing=False)
