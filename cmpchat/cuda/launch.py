"""A kernel launch as data: what to run, on what grid, with which arguments.

Kernel modules' launchers return `Launch` objects instead of launching, so the engine can run them
eagerly through Numba (debugging, tests, the simulator) or record them once into a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Dim = int | tuple[int, ...]


@dataclass(frozen=True)
class Launch:
    dispatcher: Any
    """The Numba dispatcher made by `cmpchat.cuda.compile.kernel`."""
    grid: Dim
    block: Dim
    args: tuple[Any, ...]
    shared_bytes: int = 0
    """Dynamic shared memory; above 48 KB the kernel attribute must be raised first (DESIGN.md)."""

    def run(self, stream: Any = 0) -> None:
        """Launch through Numba's own path (argument marshalling per call: slow, simple, simulator-safe)."""
        self.dispatcher[self.grid, self.block, stream, self.shared_bytes](*self.args)
