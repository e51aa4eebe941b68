"""A memory-mapped GGUF file: metadata as Python values, tensors as zero-copy views.

Built on the `gguf` package's reader. Nothing is read into memory up front beyond the header: tensor data
stays in the page cache until a caller touches it, so a mining box with little RAM can open a 27B file.
Every way a file can be unusable ends in a `CmpchatError` naming the file and the problem.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from cmpchat.errors import CmpchatError
from cmpchat.model.quant import q8_0_dequantize, q8_0_split

GGUF_MAGIC = b"GGUF"

# The tensor types the engine computes with; anything else is refused by name.
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
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


class ModelFile:
    """An open GGUF file. Cheap to create; tensor bytes are read only when asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for tensor in self._reader.tensors:
            info = TensorInfo(
                name=tensor.name,
                type=tensor.tensor_type,
                shape=tuple(int(d) for d in reversed(tensor.shape.tolist())),
                offset=tensor.data_offset,
                n_bytes=int(tensor.n_bytes),
            )
            if info.type not in SUPPORTED_TYPES:
                raise CmpchatError(
                    f"{self.path.name}: tensor '{info.name}' has type {info.type_name}, which cmpchat does not "
                    f"support (it reads F32, F16, BF16 and Q8_0); use a Q8_0 GGUF of the model"
                )
            self.tensors[info.name] = info

    def __repr__(self) -> str:
        return f"ModelFile({str(self.path)!r})"

    # -- metadata ---------------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key/value field as plain Python values (str, int, float, bool, lists of those)."""
        return {name: _field_value(field) for name, field in self._reader.fields.items() if not name.startswith("GGUF.")}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value the model cannot work without."""
        if key not in self.metadata:
            raise CmpchatError(f"{self.path.name}: metadata key '{key}' is missing; the file is incomplete or not a model cmpchat supports")
        return self.metadata[key]

    # -- tensors ----------------------------------------------------------------------------------

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor_info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise CmpchatError(f"{self.path.name}: tensor '{name}' is missing; the file is incomplete or was made for another model")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file."""
        info = self.tensor_info(name)
        return self._reader.data[info.offset : info.offset + info.n_bytes]

    def q8_0_parts(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(scales fp16 [rows, cols/32], quants int8 [rows, cols/32, 32]) views of a Q8_0 matrix."""
        info = self.tensor_info(name)
        if info.type != GGMLQuantizationType.Q8_0:
            raise ValueError(f"{name} is {info.type_name}, not Q8_0")
        rows, cols = _as_matrix_shape(info.shape)
        return q8_0_split(self.raw(name), rows, cols)

    def dequantize(self, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Exact float32 values, shaped as `shape` (numpy order); `rows` selects rows of a matrix."""
        info = self.tensor_info(name)
        if rows is not None and len(info.shape) != 2:
            raise ValueError(f"{name} is not a matrix")
        if info.type == GGMLQuantizationType.Q8_0:
            scales, quants = self.q8_0_parts(name)
            if rows is not None:
                scales, quants = scales[rows], quants[rows]
            values = q8_0_dequantize(scales, quants)
            return values if rows is not None else values.reshape(info.shape)
        values = self._plain_view(info)
        if rows is not None:
            values = values[rows]
        return _to_float32(values, info.type)

    def _plain_view(self, info: TensorInfo) -> np.ndarray:
        raw = self._reader.data[info.offset : info.offset + info.n_bytes]
        dtype = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.BF16: np.uint16,
        }[info.type]
        return raw.view(dtype).reshape(info.shape)


def _to_float32(values: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    if tensor_type == GGMLQuantizationType.BF16:
        # bf16 is the top half of an fp32: shift it back into place.
        return (values.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(values, dtype=np.float32)


def _as_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows, cols


def _open_reader(path: Path) -> GGUFReader:
    name = path.name
    if not path.exists():
        raise CmpchatError(f"{path}: no such file; give the path of a .gguf model file")
    if path.is_dir():
        raise CmpchatError(f"{path} is a folder; give the path of a .gguf model file inside it")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise CmpchatError(f"{name} is not a GGUF file; cmpchat reads GGUF models (e.g. a Qwen3.5 Q8_0 .gguf from llama.cpp's converter)")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CmpchatError(f"{name} is damaged or truncated ({err}); download or convert it again") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        if tensor.data_offset + tensor.n_elements * type_size // block_size > size:
            raise CmpchatError(f"{name} is truncated: tensor '{tensor.name}' runs past the end of the file; download or convert it again")
    return reader


def _field_value(field: Any) -> Any:
    """A reader field as a Python value; string arrays become list[str], numeric arrays list[int|float]."""
    main_type = field.types[0]
    if main_type == GGUFValueType.ARRAY:
        sub_type = field.types[-1]
        if sub_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        # Numeric array elements are consecutive parts of one dtype: join them in one step.
        values = np.concatenate([field.parts[i] for i in field.data])
        return values.tolist()
    if main_type == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]
