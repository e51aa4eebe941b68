"""Small helpers for device arrays the GPU backend allocates: zeroed buffers, views, ordering events, and image
rows placed where a step's embedding would write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.base import ImageRows
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.kernels.elementwise import PLACED_ROW


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


def images_within(images: Sequence[ImageRows], start: int, end: int) -> list[ImageRows]:
    """The parts of `images` (placed among a prompt's tokens) that fall in its tokens `start .. end`, placed
    among those."""
    parts = []
    for image in images:
        lo, hi = max(image.start, start), min(image.start + len(image.rows), end)
        if lo < hi:
            parts.append(ImageRows(lo - start, image.rows[lo - image.start : hi - image.start]))
    return parts


def mark_placed(tokens: np.ndarray, images: Sequence[ImageRows]) -> None:
    """Mark the images' tokens `PLACED_ROW` (in place), so the step's embedding leaves their hidden rows."""
    for image in images:
        tokens[image.start : image.start + len(image.rows)] = PLACED_ROW


def place_image_rows(hidden: Any, images: Sequence[ImageRows], stream: Any) -> None:
    """Queue the copy of each image's rows (C-contiguous float32) into its rows of `hidden` [rows, d] (from
    pageable memory: staged before the call returns, so the caller may drop them)."""
    for image in images:
        hidden[image.start : image.start + len(image.rows)].copy_to_device(image.rows, stream=stream)
