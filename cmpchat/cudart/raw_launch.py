"""Raw launches: a `Launch` bound once to its compiled kernel and packed parameters, then run with one
`cuLaunchKernel` call (about 5 µs instead of Numba's 12–50 µs) or recorded into a CUDA graph (`graph.py`).

Binding compiles the dispatcher for the launch's argument types exactly as Numba's own launch would
(`typeof_pyval` of each argument, then `dispatcher.compile`), so both paths run the same machine code, and
reuses the module Numba loaded (one copy per context, Numba's module setup done). The parameters are packed
as `kernel_args` describes and checked against the driver's own parameter table for the kernel.

Kernels defined with `early_launch` are launched with programmatic stream serialization (`cuLaunchKernelEx`)
when the caller asks for it (`RawLaunch(launch, early_launch=True)`: the device's choice, `DeviceTuning.early_launch`
in `cmpchat/kernels/device_table.py`, which only sm_90+ has): the driver may start one while the launch before it
on the stream still runs, and the kernel's `wait_for_prior_grids()` holds it until that launch is done; a graph
captured from such launches keeps those edges. It hides each launch's start (block scheduling, the prologue's
independent part) behind the tail of the one before. CMPCHAT_EARLY_LAUNCH=0 in the environment turns it off
whatever the caller asks (to rule it out when hunting a race); the simulator never launches early.

The arguments are frozen at binding: device arrays by address (they must outlive the RawLaunch, which
keeps a reference), scalars by value. Values that change from call to call belong in device memory
(`DeviceScalars`). Under the CUDA simulator a RawLaunch runs its Launch through Numba, so engine code that
uses raw launches and graphs also runs in CI.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from cmpchat.cudart.compile import is_early_launch
from cmpchat.cudart.driver_api import SUCCESS, CudaDriverError, check, stream_handle
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.cudart.kernel_args import PackedParams, kernel_params, pack_params
from cmpchat.cudart.launch import Dim, Launch

if not SIMULATOR:
    from cuda.bindings import driver

STATIC_SHARED_LIMIT = 48 * 1024
"""Dynamic shared memory above this needs the kernel attribute raised first (docs/hardware.md, "Numba-CUDA facts that shape the code")."""


def early_launch_allowed() -> bool:
    """Whether a launch asked to start early may: not under the simulator, not turned off in the environment
    (CMPCHAT_EARLY_LAUNCH=0). Whether the GPU has early launch is the caller's to know (it asks only on sm_90+)."""
    return not SIMULATOR and os.environ.get("CMPCHAT_EARLY_LAUNCH", "1") != "0"


@dataclass(slots=True)
class _BoundFunction:
    """A kernel's `CUfunction` in the current context, with what the driver says of its parameters."""

    name: str
    function: Any
    param_table: tuple[tuple[int, int], ...] | None
    """(offset, size) per parameter, or None where the driver cannot tell (cuFuncGetParamInfo is 12.4+)."""
    dynamic_shared_limit: int = STATIC_SHARED_LIMIT


_BOUND: dict[Any, _BoundFunction] = {}
"""Per Numba `CudaPythonFunction` (one per kernel and context): binding is done once."""


class RawLaunch:
    """A `Launch` ready for the driver; call it with a stream to launch."""

    __slots__ = ("launch", "kernel_name", "early", "_function", "_grid", "_block", "_buffer", "_pointers",
                 "_params_address", "_config")  # fmt: skip

    def __init__(self, launch: Launch, *, early_launch: bool = False) -> None:
        """`early_launch`: launch it early if its kernel allows that (see the module's docstring); only for a
        GPU that has early launch (sm_90+)."""
        self.launch = launch
        self.early = early_launch and is_early_launch(launch.dispatcher) and early_launch_allowed()
        if SIMULATOR:
            self.kernel_name = getattr(launch.dispatcher, "__name__", "kernel")
            return
        kernel, argtypes = _compile(launch)
        bound = _bind(kernel)
        # The dispatcher's Python function names the kernel even when Numba loaded it from its disk cache.
        self.kernel_name = getattr(getattr(launch.dispatcher, "py_func", None), "__name__", None) or bound.name
        packed = pack_params(kernel_params(argtypes, launch.args))
        _check_layout(bound, packed)
        _allow_dynamic_shared(bound, launch.shared_bytes)
        self._function = bound.function
        self._grid = _dim3(launch.grid)
        self._block = _dim3(launch.block)
        # The driver copies each parameter through a pointer when the kernel is launched (or captured), so
        # the buffer and the pointer array live as long as this object.
        self._buffer = ctypes.create_string_buffer(packed.buffer, max(len(packed.buffer), 1))
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(len(packed.offsets), 1))(*(base + o for o in packed.offsets))
        self._params_address = ctypes.addressof(self._pointers) if packed.offsets else 0
        self._config = _early_launch_config(self._grid, self._block, launch.shared_bytes) if self.early else None

    def __call__(self, stream: Any = 0) -> None:
        """Launch on `stream` (a Numba/cuda.core/PyTorch stream, a CUstream or an int handle)."""
        if SIMULATOR:
            self.launch.run(stream)
            return
        if self._config is not None:
            self._config.hStream = stream_handle(stream)
            result = driver.cuLaunchKernelEx(self._config, self._function, self._params_address, 0)
            if result[0] != SUCCESS:
                check(f"cuLaunchKernelEx({self.kernel_name})", result)
            return
        result = driver.cuLaunchKernel(
            self._function, *self._grid, *self._block, self.launch.shared_bytes, stream_handle(stream),
            self._params_address, 0,
        )  # fmt: skip
        if result[0] != SUCCESS:  # the message is built only on failure: this is the hot path
            check(f"cuLaunchKernel({self.kernel_name})", result)

    def __repr__(self) -> str:
        return f"RawLaunch({self.kernel_name}, grid={self.launch.grid}, block={self.launch.block})"


def _compile(launch: Launch) -> tuple[Any, tuple[Any, ...]]:
    """The Numba `_Kernel` that `dispatcher[grid, block](*args)` would launch, and its argument types."""
    dispatcher = launch.dispatcher
    if dispatcher.targetoptions.get("extensions"):
        raise TypeError("kernels with Numba argument extensions need Launch.run; the raw launcher skips them")
    argtypes = tuple(dispatcher.typeof_pyval(value) for value in launch.args)
    kernel = dispatcher.compile(argtypes)
    if kernel.cooperative:
        raise TypeError(f"{kernel.entry_name} is a cooperative kernel; the raw launcher does not launch those")
    return kernel, argtypes


def _bind(kernel: Any) -> _BoundFunction:
    kernel.bind()  # loads the module into the current context once and runs Numba's module setup
    cufunc = kernel.library.get_cufunc()
    bound = _BOUND.get(cufunc)
    if bound is None:
        # Numba loads modules through cuda.core's library API, so the handle is a context-free CUkernel;
        # attributes and parameter info belong to the CUfunction of the current context.
        handle = cufunc.handle
        if isinstance(handle, driver.CUfunction):
            function = handle
        else:
            function = check("cuKernelGetFunction", driver.cuKernelGetFunction(int(handle)))
        # A kernel loaded from Numba's on-disk cache has no py_func.
        name = getattr(getattr(kernel, "py_func", None), "__qualname__", None) or cufunc.name
        bound = _BoundFunction(name, function, _param_table(function))
        _BOUND[cufunc] = bound
    return bound


def _param_table(function: Any) -> tuple[tuple[int, int], ...] | None:
    get_info = getattr(driver, "cuFuncGetParamInfo", None)
    if get_info is None:
        return None
    table: list[tuple[int, int]] = []
    while True:
        try:
            result = get_info(function, len(table))
        except RuntimeError:  # cuda-bindings raises when the installed driver lacks the entry point
            return None
        if result[0] == driver.CUresult.CUDA_ERROR_INVALID_VALUE:  # past the last parameter
            return tuple(table)
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            return None
        table.append((int(result[1]), int(result[2])))


def _check_layout(bound: _BoundFunction, packed: PackedParams) -> None:
    """Refuse to launch when the packing disagrees with the kernel the driver loaded.

    Only count and sizes matter here: the driver copies each parameter's size from its own pointer.
    (The offsets follow the same natural alignment; the GPU tests compare them too.)
    """
    if bound.param_table is None:
        return
    sizes = [param.size for param in packed.params]
    kernel_sizes = [size for _, size in bound.param_table]
    if len(sizes) != len(kernel_sizes):
        raise CudaDriverError(f"{bound.name}: {len(sizes)} parameters packed, the kernel takes {len(kernel_sizes)}")
    for index, (mine, theirs) in enumerate(zip(sizes, kernel_sizes)):
        if mine != theirs:
            name = packed.params[index].name
            raise CudaDriverError(
                f"{bound.name}: parameter {index} ({name}) packed as {mine} bytes, kernel has {theirs}"
            )


def _allow_dynamic_shared(bound: _BoundFunction, shared_bytes: int) -> None:
    if shared_bytes <= bound.dynamic_shared_limit:
        return
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(f"cuFuncSetAttribute({bound.name})", driver.cuFuncSetAttribute(bound.function, attribute, shared_bytes))
    bound.dynamic_shared_limit = shared_bytes


def _early_launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int) -> Any:
    """A `CUlaunchConfig` allowing programmatic stream serialization; the stream is set per launch."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_bytes
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


def _dim3(dim: Dim) -> tuple[int, int, int]:
    extents = (dim,) if isinstance(dim, int) else tuple(dim)
    if not 1 <= len(extents) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, not {dim!r}")
    padded = tuple(int(e) for e in extents) + (1,) * (3 - len(extents))
    return padded[0], padded[1], padded[2]
