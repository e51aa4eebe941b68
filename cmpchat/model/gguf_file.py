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
from cmpchat.model.dequant import BLOCK_FORMATS, READABLE_TYPES, dequantize_rows, type_names
from cmpchat.model.gguf_parse import TensorInfo, parse
from cmpchat.model.quant import q8_0_split


class ModelFile:
    """An open GGUF file. Cheap to create; tensor bytes are read only when asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._data, self.metadata, self.tensors = parse(self.path)
        for info in self.tensors.values():
            if info.type not in READABLE_TYPES:
                raise CmpchatError(
                    f"{self.path.name}: tensor '{info.name}' has type {info.type_name}, which cmpchat does not "
                    f"read (it reads {type_names(READABLE_TYPES)}); use a Q4_K_M, Q5_K_M, Q6_K or Q8_0 GGUF of the model"
                )
            block = BLOCK_FORMATS.get(info.type)
            if block is not None and info.shape and info.shape[-1] % block.values:
                raise CmpchatError(
                    f"{self.path.name} is damaged: tensor '{info.name}' ({info.type_name}) has rows of "
                    f"{info.shape[-1]} values, not a whole number of {block.values}-value blocks"
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

    def raw_rows(self, name: str) -> np.ndarray:
        """The tensor's bytes as rows, uint8 [rows, bytes a row] (a view of the mapped file); a row is the last
        dimension (numpy order), a whole number of blocks."""
        info = self.tensor_info(name)
        rows, _ = _as_matrix_shape(info.shape)
        return self.raw(name).reshape(rows, -1)

    def dequantize(self, name: str, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Exact float32 values, shaped as `shape` (numpy order); `rows` selects rows of a matrix."""
        info = self.tensor_info(name)
        if rows is not None and len(info.shape) != 2:
            raise ValueError(f"{name} is not a matrix")
        raw = self.raw_rows(name)
        if rows is not None:
            return dequantize_rows(raw[rows], info.type, info.shape[-1])
        return dequantize_rows(raw, info.type, info.shape[-1]).reshape(info.shape)

    def type_mix(self) -> list[tuple[GGMLQuantizationType, int, int]]:
        """(type, tensors, bytes) for each tensor type in the file, most bytes first."""
        counts: dict[GGMLQuantizationType, list[int]] = {}
        for info in self.tensors.values():
            entry = counts.setdefault(info.type, [0, 0])
            entry[0] += 1
            entry[1] += info.n_bytes
        return sorted(((t, n, b) for t, (n, b) in counts.items()), key=lambda item: (-item[2], item[0].name))


def _as_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows, cols
