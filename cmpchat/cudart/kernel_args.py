"""How a Numba-CUDA kernel receives its arguments, as plain data (no GPU, no driver).

Numba flattens every kernel argument into primitive parameters (numba-cuda's `ArgPacker` over its data
models, `numba/cuda/datamodel/cuda_packer.py` and `cuda_models.py`), and its launcher fills them in
`_Kernel._prepare_args` (`numba/cuda/dispatcher.py`). For an array of `ndim` dimensions (`ArrayModel`):

    meminfo (pointer, 0 on the device)  parent (pointer, 0)  nitems (intp)  itemsize (intp)
    data (pointer)  shape[0..ndim) (intp each)  strides[0..ndim) (intp each, in bytes)

and a scalar is one parameter of its C type (bool one byte, float16 its 16 bits). Tuples flatten member by
member, complex numbers into real and imaginary parts. The raw launcher packs the same list once per
launch, so `cuLaunchKernel` (or a CUDA graph) can run the kernel without Numba's per-call marshalling.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from numba import types

POINTER = "Q"
INTP = "q"

_INTEGER_FORMATS = {(8, True): "b", (16, True): "h", (32, True): "i", (64, True): "q"}
_INTEGER_FORMATS |= {(8, False): "B", (16, False): "H", (32, False): "I", (64, False): "Q"}
_FLOAT_FORMATS = {16: "e", 32: "f", 64: "d"}


@dataclass(frozen=True, slots=True)
class DeviceArrayArg:
    """What a kernel needs of a device array: its address and geometry."""

    data: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    """In bytes, as Numba passes them."""
    itemsize: int

    @property
    def nitems(self) -> int:
        count = 1
        for extent in self.shape:
            count *= extent
        return count


@dataclass(frozen=True, slots=True)
class Param:
    """One primitive kernel parameter: a name for messages, a `struct` format code and its value."""

    name: str
    format: str
    value: int | float | bool | None
    """None where only the layout was asked for."""

    @property
    def size(self) -> int:
        return struct.calcsize(self.format)

    @property
    def is_float(self) -> bool:
        return self.format in "fd"


@dataclass(frozen=True, slots=True)
class PackedParams:
    """Parameters laid out in one buffer, each at its natural alignment (the CUDA parameter ABI)."""

    params: tuple[Param, ...]
    offsets: tuple[int, ...]
    buffer: bytes


def describe_device_array(value: Any) -> DeviceArrayArg:
    """Read a device array's address and geometry from its `__cuda_array_interface__`.

    Numba device arrays, CuPy arrays and PyTorch CUDA tensors all qualify. Host arrays are refused: Numba
    would copy them to the device on every launch, which a raw launch or a graph cannot do.
    """
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(
            f"raw launches take device arrays (with __cuda_array_interface__), not {type(value).__name__}; "
            "copy host arrays to the device once, before building the launch"
        )
    shape = tuple(int(extent) for extent in interface["shape"])
    itemsize = int(interface["typestr"][2:])  # '<f4', '|i1', '|V12': byte order, kind, size in bytes
    strides = interface.get("strides")
    if strides is None:
        strides = _c_contiguous_strides(shape, itemsize)
    return DeviceArrayArg(int(interface["data"][0]), shape, tuple(int(s) for s in strides), itemsize)


def kernel_params(argtypes: Sequence[types.Type], values: Sequence[Any] | None = None) -> list[Param]:
    """Flatten kernel arguments of the given Numba types into primitive parameters, in ABI order.

    Without `values` only the layout (names and formats) is produced, e.g. to compare with a PTX entry.
    Arrays may be given as `DeviceArrayArg` or as any object with `__cuda_array_interface__`.
    """
    if values is not None and len(values) != len(argtypes):
        raise TypeError(f"{len(argtypes)} argument types but {len(values)} values")
    params: list[Param] = []
    for index, argtype in enumerate(argtypes):
        value = None if values is None else values[index]
        params.extend(_flatten(argtype, value, f"arg{index}"))
    return params


def pack_params(params: Sequence[Param]) -> PackedParams:
    """Lay parameters out in one buffer, each aligned to its own size, the whole padded to 8 bytes."""
    offsets: list[int] = []
    end = 0
    for param in params:
        offset = -(-end // param.size) * param.size
        offsets.append(offset)
        end = offset + param.size
    buffer = bytearray(-(-end // 8) * 8)
    for param, offset in zip(params, offsets):
        if param.value is None:
            raise ValueError(f"parameter {param.name} has no value")
        try:
            struct.pack_into("<" + param.format, buffer, offset, param.value)
        except struct.error as error:
            raise ValueError(f"parameter {param.name}: {param.value!r} does not fit format {param.format!r}") from error
    return PackedParams(tuple(params), tuple(offsets), bytes(buffer))


def _flatten(argtype: types.Type, value: Any, name: str) -> Iterator[Param]:
    if isinstance(argtype, types.Array):
        yield from _array_params(argtype, value, name)
    elif isinstance(argtype, types.Boolean):
        yield Param(name, "?", None if value is None else bool(value))
    elif isinstance(argtype, types.Integer):
        yield Param(name, _INTEGER_FORMATS[argtype.bitwidth, argtype.signed], None if value is None else int(value))
    elif isinstance(argtype, types.Float):
        yield Param(name, _FLOAT_FORMATS[argtype.bitwidth], None if value is None else float(value))
    elif isinstance(argtype, types.Complex):
        part = _FLOAT_FORMATS[argtype.bitwidth // 2]
        yield Param(f"{name}.real", part, None if value is None else float(complex(value).real))
        yield Param(f"{name}.imag", part, None if value is None else float(complex(value).imag))
    elif isinstance(argtype, types.BaseTuple):
        if value is not None and len(value) != len(argtype):
            raise TypeError(f"{name}: a tuple of {len(argtype)} expected, got {len(value)} items")
        for index, member in enumerate(argtype):
            yield from _flatten(member, None if value is None else value[index], f"{name}[{index}]")
    elif isinstance(argtype, types.CPointer):
        yield Param(name, POINTER, None if value is None else int(value))
    else:
        raise TypeError(f"{name}: the raw launcher cannot pass a {argtype}; use Launch.run for such kernels")


def _array_params(argtype: types.Array, value: Any, name: str) -> Iterator[Param]:
    array = None
    if value is not None:
        array = value if isinstance(value, DeviceArrayArg) else describe_device_array(value)
        if len(array.shape) != argtype.ndim:
            raise TypeError(f"{name}: {argtype.ndim}-d array type but the value has {len(array.shape)} dimensions")
    yield Param(f"{name}.meminfo", POINTER, None if array is None else 0)
    yield Param(f"{name}.parent", POINTER, None if array is None else 0)
    yield Param(f"{name}.nitems", INTP, None if array is None else array.nitems)
    yield Param(f"{name}.itemsize", INTP, None if array is None else array.itemsize)
    yield Param(f"{name}.data", POINTER, None if array is None else array.data)
    for axis in range(argtype.ndim):
        yield Param(f"{name}.shape[{axis}]", INTP, None if array is None else array.shape[axis])
    for axis in range(argtype.ndim):
        yield Param(f"{name}.strides[{axis}]", INTP, None if array is None else array.strides[axis])


def _c_contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Row-major strides as Numba computes them (`numpy_support.strides_from_shape`)."""
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))
