"""Parsing a GGUF file's header: key/value metadata and the tensor index, over one memory map.

The `gguf` package's reader builds a numpy object per array element, which takes ~12 s for the 500K
strings of a Qwen3.5 vocabulary; this parser reads the same layout (the package's constants) in well
under a second and then hands out zero-copy views. Layout: magic, version, tensor count, field count,
fields (key, type, value), tensor infos (name, dims, type, offset), padding to the alignment, data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT

from cmpchat.errors import CmpchatError
from cmpchat.model.dequant import READABLE_TYPES, type_names

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

_SCALARS: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives and what it holds. `shape` is in numpy order: (rows = outputs, cols = inputs)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return self.type.name


class _Truncated(Exception):
    pass


class _Cursor:
    """Reads little-endian values from a buffer, moving forward."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise _Truncated
        value = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise _Truncated
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        end = self.offset + dtype.itemsize * count
        if end > len(self.buffer):
            raise _Truncated
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
        self.offset = end
        return values

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if item_type in _SCALARS:
                return self.array(_SCALARS[item_type], count).tolist()
            return [self.value(item_type) for _ in range(count)]
        return self.array(_SCALARS[value_type], 1).tolist()[0]


def read_scalar_metadata(path: Path, limit: int = 256 * 1024) -> dict[str, Any] | None:
    """The scalar metadata at the start of a GGUF file, up to its first array (the vocabulary), from its first
    `limit` bytes: a quick look for model pickers. None if the file cannot be read or is not GGUF."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(limit)
    except OSError:
        return None
    if head[:4] != GGUF_MAGIC:
        return None
    cursor = _Cursor(memoryview(head))
    cursor.offset = 4
    values: dict[str, Any] = {}
    try:
        if cursor.unpack("<I") not in SUPPORTED_VERSIONS:
            return None
        _, field_count = cursor.unpack("<QQ")
        for _ in range(field_count):
            key = cursor.string()
            value_type = GGUFValueType(cursor.unpack("<I"))
            if value_type == GGUFValueType.ARRAY:
                break
            values[key] = cursor.value(value_type)
    except (_Truncated, ValueError):
        pass  # a header longer than what was read, or damaged: keep what was found
    return values


def parse(path: Path) -> tuple[np.ndarray, dict[str, Any], dict[str, TensorInfo]]:
    """(the file as a read-only uint8 array, metadata, tensor index); `CmpchatError` for unusable files."""
    name = path.name
    if not path.exists():
        raise CmpchatError(f"{path}: no such file; give the path of a .gguf model file")
    if path.is_dir():
        raise CmpchatError(f"{path} is a folder; give the path of a .gguf model file inside it")
    size = path.stat().st_size
    if size < 4:
        raise CmpchatError(f"{name} is not a GGUF file (it is {size} bytes long)")
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, dtype=np.uint8)
    cursor = _Cursor(memoryview(mapped))
    if bytes(data[:4]) != GGUF_MAGIC:
        raise CmpchatError(
            f"{name} is not a GGUF file; cmpchat reads GGUF models (e.g. a Qwen3.5 Q8_0 .gguf from llama.cpp's converter)"
        )
    cursor.offset = 4
    try:
        version = cursor.unpack("<I")
        if version not in SUPPORTED_VERSIONS:
            raise CmpchatError(f"{name} is GGUF version {version}; cmpchat reads versions 2 and 3 (little-endian)")
        tensor_count, field_count = cursor.unpack("<QQ")
        metadata: dict[str, Any] = {}
        for _ in range(field_count):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.unpack("<I")))
        infos = []
        for _ in range(tensor_count):
            tensor_name = cursor.string()
            n_dims = cursor.unpack("<I")
            dims = [int(d) for d in cursor.array(np.dtype("<u8"), n_dims)]
            tensor_type = _tensor_type(cursor.unpack("<I"), tensor_name, name)
            infos.append((tensor_name, dims, tensor_type, cursor.unpack("<Q")))
    except _Truncated:
        raise CmpchatError(f"{name} is truncated (its header ends early); download or convert it again") from None
    except ValueError as err:  # an unknown value type code
        raise CmpchatError(f"{name} is damaged ({err}); download or convert it again") from None

    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for tensor_name, dims, tensor_type, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims)) if dims else 1
        n_bytes = n_elements // block_size * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise CmpchatError(
                f"{name} is truncated: tensor '{tensor_name}' runs past the end of the file; download or convert it again"
            )
        tensors[tensor_name] = TensorInfo(tensor_name, tensor_type, tuple(reversed(dims)), start, n_bytes)
    return data, metadata, tensors


def _tensor_type(code: int, tensor_name: str, file_name: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(code)
    except ValueError:
        raise CmpchatError(
            f"{file_name}: tensor '{tensor_name}' has unknown type code {code}; "
            f"cmpchat reads {type_names(READABLE_TYPES)}"
        ) from None
