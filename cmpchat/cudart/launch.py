"""A kernel launch as data: what to run, on what grid, with which arguments.

Kernel modules' launchers return `Launch` objects instead of launching, so the engine can run them
eagerly through Numba (debugging, tests, the simulator) or record them once into a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

Dim = int | tuple[int, ...]


@dataclass(frozen=True)
class Launch:
    dispatcher: Any
    """The Numba dispatcher made by `cmpchat.cudart.compile.kernel`."""
    grid: Dim
    block: Dim
    args: tuple[Any, ...]
    shared_bytes: int = 0
    """Dynamic shared memory; above 48 KB the kernel attribute must be raised first (docs/hardware.md, "Numba-CUDA facts")."""

    def run(self, stream: Any = 0) -> None:
        """Launch through Numba's own path (argument marshalling per call: slow, simple, simulator-safe)."""
        self.dispatcher[self.grid, self.block, stream, self.shared_bytes](*self.args)


def check_array(array: Any, name: str, dtype: Any, ndim: int, shape: tuple[int, ...] | None = None) -> tuple:
    """Raise ValueError unless `array` is a C-contiguous array of that dtype, rank and shape; its shape.

    Launchers check their arguments with this before building a `Launch`: a wrong layout would otherwise
    read or write the wrong memory silently.
    """
    actual = tuple(int(n) for n in array.shape)
    if np.dtype(array.dtype) != np.dtype(dtype) or len(actual) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D {np.dtype(dtype).name} array, got {array.dtype} {actual}")
    if shape is not None and actual != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {actual}")
    contiguous = array.is_c_contiguous() if hasattr(array, "is_c_contiguous") else array.flags.c_contiguous
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return actual
