"""A memory-mapped GGUF file: metadata as Python values, tensors as zero-copy views.

Parsed by `gguf_parse` with the `gguf` package's constants. Nothing is read into memory up front beyond the header: tensor data
stays in the page cache until a caller touches it, so a mining box with little RAM can open a 27B file.
Every way a file can be unusable ends in a `CmpchatError` naming the file and the problem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_parse import TensorInfo, parse
from cmpchat.model.quant import q8_0_dequantize, q8_0_split

# The tensor types the engine computes with; anything else is refused by name.
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
}


class ModelFile:
    """An open GGUF file. Cheap to create; tensor bytes are read only when asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._data, self.metadata, self.tensors = parse(self.path)
        for info in self.tensors.values():
            if info.type not in SUPPORTED_TYPES:
                raise CmpchatError(
                    f"{self.path.name}: tensor '{info.name}' has type {info.type_name}, which cmpchat does not "
                    f"support (it reads F32, F16, BF16 and Q8_0); use a Q8_0 GGUF of the model"
                )

    def __repr__(self) -> str:
        return f"ModelFile({str(self.path)!r})"

    # -- metadata ---------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value the model cannot work without."""
        if key not in self.metadata:
            raise CmpchatError(
                f"{self.path.name}: metadata key '{key}' is missing; the file is incomplete or not a model cmpchat supports"
            )
        return self.metadata[key]

    # -- tensors ----------------------------------------------------------------------------------

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor_info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise CmpchatError(
                f"{self.path.name}: tensor '{name}' is missing; the file is incomplete or was made for another model"
            )
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file."""
        info = self.tensor_info(name)
        return self._data[info.offset : info.offset + info.n_bytes]

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
        raw = self._data[info.offset : info.offset + info.n_bytes]
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
