"""The `kernel` decorator: a lazily compiled Numba-CUDA kernel, listed with its launch signatures.

The registry lets the PTX check compile every engine kernel for compute_70 on a machine without a GPU
(`python -m cmpchat.devtools.ptx_check`) and lets the GPU tests find every kernel's SASS. Signatures are
Numba signature strings for the argument types the engine launches the kernel with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from numba import cuda

from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.target import activate

activate()  # the code path CMPCHAT_PROFILE names (cudart/target.py), before any kernel below is defined


@dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str
    signatures: tuple[str, ...]
    dispatcher: Any
    early_launch: bool = False


KERNELS: list[KernelSpec] = []


def kernel(
    *signatures: str,
    launch_bounds: int | tuple[int, int] | None = None,
    early_launch: bool = False,
) -> Callable[[Callable[..., None]], Any]:
    """Define a kernel compiled on first launch (cached on disk) and register its signatures.

    `launch_bounds` is the most threads per block the kernel is launched with, optionally with the fewest
    blocks per SM wanted: (threads, blocks); ptxas then keeps its registers low enough for that (e.g. 64 per
    thread for 1024 threads).

    `early_launch` says the kernel calls `intrinsics.wait_for_prior_grids()` before it touches memory that
    earlier launches write (and before any store), so on sm_90+ a raw launch may start it while the launch
    before it still runs (`is_early_launch`).
    """
    if not signatures:
        raise ValueError("a kernel needs at least one launch signature for the PTX check")

    def define(function: Callable[..., None]) -> Any:
        options: dict[str, Any] = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
        dispatcher = cuda.jit(function) if SIMULATOR else cuda.jit(cache=True, **options)(function)
        spec = KernelSpec(function.__qualname__, function.__module__, signatures, dispatcher, early_launch)
        KERNELS.append(spec)
        if early_launch:
            _EARLY_LAUNCH.add(id(dispatcher))
        return dispatcher

    return define


_EARLY_LAUNCH: set[int] = set()
"""ids of the dispatchers defined with early_launch (KERNELS keeps each alive, so no id is reused)."""


def is_early_launch(dispatcher: Any) -> bool:
    """Whether the kernel was defined with `early_launch=True`."""
    return id(dispatcher) in _EARLY_LAUNCH
