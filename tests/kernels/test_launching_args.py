"""How the raw launcher packs kernel arguments, checked field by field against numba-cuda's own data model
(the `ArgPacker` that flattens a kernel's arguments when Numba compiles it). CPU only."""

from __future__ import annotations

import struct

import numba.cuda.extending  # noqa: F401  (loads the CUDA models before `numba.cuda.models`: import cycle)
import numpy as np
import pytest
from llvmlite import ir
from numba import types
from numba.cuda.datamodel import default_manager
from numba.cuda.datamodel.cuda_packer import ArgPacker
from numba.cuda.models import cuda_data_manager

from cmpchat.cudart.driver_api import CudaDriverError, stream_handle
from cmpchat.cudart.kernel_args import DeviceArrayArg, describe_device_array, kernel_params, pack_params
from cmpchat.cudart.raw_launch import _BoundFunction, _check_layout, _dim3

CUDA_MODELS = cuda_data_manager.chain(default_manager)

ARGUMENT_TYPES = [
    types.Array(types.float32, 1, "C"),
    types.Array(types.int8, 2, "C"),
    types.Array(types.float16, 3, "A"),
    types.Array(types.uint32, 4, "F"),
    types.int8, types.int16, types.int32, types.int64,
    types.uint8, types.uint16, types.uint32, types.uint64,
    types.float16, types.float32, types.float64, types.boolean,
    types.complex64, types.complex128,
    types.UniTuple(types.int32, 3),
    types.Tuple((types.float32, types.Array(types.int32, 1, "C"), types.boolean)),
]  # fmt: skip


def llvm_size_and_kind(llvm_type: ir.Type) -> tuple[int, bool]:
    """Bytes and whether it is floating point, for the primitive LLVM types Numba passes to kernels."""
    if isinstance(llvm_type, ir.PointerType):
        return 8, False
    if isinstance(llvm_type, ir.IntType):
        return llvm_type.width // 8, False
    if isinstance(llvm_type, ir.FloatType):
        return 4, True
    if isinstance(llvm_type, ir.DoubleType):
        return 8, True
    raise AssertionError(f"unexpected kernel parameter type {llvm_type}")


@pytest.mark.parametrize("argtype", ARGUMENT_TYPES, ids=str)
def test_each_parameter_matches_numbas_flattened_argument(argtype):
    numba_params = ArgPacker(CUDA_MODELS, [argtype]).argument_types
    ours = kernel_params([argtype])
    assert [(p.size, p.is_float) for p in ours] == [llvm_size_and_kind(t) for t in numba_params]


def test_a_whole_argument_list_flattens_in_order():
    numba_params = ArgPacker(CUDA_MODELS, ARGUMENT_TYPES).argument_types
    ours = kernel_params(ARGUMENT_TYPES)
    assert [(p.size, p.is_float) for p in ours] == [llvm_size_and_kind(t) for t in numba_params]


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_array_fields_follow_numbas_array_model(ndim):
    argtype = types.Array(types.float32, ndim, "C")
    model = CUDA_MODELS.lookup(argtype)
    expected = []
    for member in model._fields:  # meminfo, parent, nitems, itemsize, data, shape, strides
        count = len(model.get_member_fe_type(member)) if member in ("shape", "strides") else 1
        expected += [member] * count
    names = [p.name.removeprefix("arg0.").split("[")[0] for p in kernel_params([argtype])]
    assert names == expected


class FakeDeviceArray:
    """Any object with a CUDA array interface, as Numba, CuPy and PyTorch provide."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str, strides=None):
        self.__cuda_array_interface__ = {
            "data": (pointer, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


def test_array_values_are_those_numba_passes():
    array = FakeDeviceArray(0x7F00_0000_1000, (3, 5), "<f4", strides=(40, 4))
    params = kernel_params([types.Array(types.float32, 2, "A")], [array])
    assert {p.name: p.value for p in params} == {
        "arg0.meminfo": 0,
        "arg0.parent": 0,
        "arg0.nitems": 15,
        "arg0.itemsize": 4,
        "arg0.data": 0x7F00_0000_1000,
        "arg0.shape[0]": 3,
        "arg0.shape[1]": 5,
        "arg0.strides[0]": 40,
        "arg0.strides[1]": 4,
    }


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6)])
def test_missing_strides_mean_row_major_as_in_numpy(shape):
    described = describe_device_array(FakeDeviceArray(256, shape, "<i2"))
    assert described.strides == np.zeros(shape, np.int16).strides
    assert described.itemsize == 2


def test_host_arrays_are_refused():
    with pytest.raises(TypeError, match="device arrays"):
        kernel_params([types.Array(types.float32, 1, "C")], [np.zeros(4, np.float32)])


def test_dimension_mismatch_is_refused():
    with pytest.raises(TypeError, match="2-d array type"):
        kernel_params([types.Array(types.float32, 2, "C")], [DeviceArrayArg(256, (4,), (4,), 4)])


def test_unsupported_types_name_the_argument():
    record = types.Record([("a", {"type": types.int32, "offset": 0})], 4, False)
    with pytest.raises(TypeError, match="arg1"):
        kernel_params([types.int32, record])


def test_scalars_pack_at_natural_alignment_with_their_values():
    argtypes = [types.boolean, types.int64, types.float16, types.int8, types.float32, types.uint16, types.float64]
    values = [True, -5, 1.5, -3, 2.25, 65535, -0.125]
    packed = pack_params(kernel_params(argtypes, values))
    assert packed.offsets == (0, 8, 16, 18, 20, 24, 32)
    assert len(packed.buffer) == 40
    unpacked = [struct.unpack_from("<" + p.format, packed.buffer, o)[0] for p, o in zip(packed.params, packed.offsets)]
    assert unpacked == values
    assert packed.buffer[16:18] == np.float16(1.5).tobytes()  # float16 as Numba sends it: its 16 bits


def test_tuples_and_complex_numbers_flatten_member_by_member():
    argtypes = [types.UniTuple(types.int32, 2), types.complex64]
    params = kernel_params(argtypes, [(4, -6), 1.5 - 2j])
    assert [(p.name, p.value) for p in params] == [
        ("arg0[0]", 4),
        ("arg0[1]", -6),
        ("arg1.real", 1.5),
        ("arg1.imag", -2.0),
    ]


def test_out_of_range_values_name_the_parameter():
    with pytest.raises(ValueError, match="arg0"):
        pack_params(kernel_params([types.int8], [300]))


def test_layout_is_checked_against_the_drivers_parameter_table():
    packed = pack_params(
        kernel_params([types.Array(types.float32, 1, "C"), types.int32], [DeviceArrayArg(256, (4,), (4,), 4), 7])
    )
    table = tuple((offset, param.size) for offset, param in zip(packed.offsets, packed.params))
    _check_layout(_BoundFunction("k", None, table), packed)
    _check_layout(_BoundFunction("k", None, None), packed)  # old drivers cannot tell: no check
    with pytest.raises(CudaDriverError, match=r"parameter 7 \(arg1\) packed as 4 bytes, kernel has 8"):
        _check_layout(_BoundFunction("k", None, table[:-1] + ((56, 8),)), packed)
    with pytest.raises(CudaDriverError, match="8 parameters packed"):
        _check_layout(_BoundFunction("k", None, table[:-1]), packed)


def test_grid_and_block_dimensions_become_three():
    assert _dim3(64) == (64, 1, 1)
    assert _dim3((4, 2)) == (4, 2, 1)
    assert _dim3((1, 2, 3)) == (1, 2, 3)
    with pytest.raises(ValueError):
        _dim3((1, 2, 3, 4))


def test_stream_handles_from_every_kind_of_stream():
    class CoreStream:
        def __cuda_stream__(self):
            return (0, 1234)

    class TorchStream:
        cuda_stream = 5678

    assert stream_handle(0) == 0
    assert stream_handle(None) == 0
    assert stream_handle(CoreStream()) == 1234
    assert stream_handle(TorchStream()) == 5678
