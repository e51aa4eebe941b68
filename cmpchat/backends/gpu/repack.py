"""Q8_0 weights regrouped for the GPU: quants and scales apart, so kernels use aligned 16-byte loads.

A file's Q8_0 rows interleave a 2-byte scale with 32 quants (34-byte blocks, so quants are never 16-byte
aligned). The GPU layout keeps all quants of a matrix contiguous ([rows, cols] int8) and the fp16 scales
in their own [rows, cols/32] array. Rows are produced in bounded chunks so host RAM stays small.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import Q8_0_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class RowChunk:
    first_row: int
    quants: np.ndarray  # int8 [rows, cols], C-contiguous
    scales: np.ndarray  # float16 [rows, cols/32], C-contiguous


def q8_0_row_chunks(model_file: ModelFile, name: str, max_bytes: int) -> Iterator[RowChunk]:
    """The Q8_0 matrix `name` in GPU layout, a few rows at a time (each chunk at most ~`max_bytes`)."""
    rows, cols = model_file.tensor_info(name).shape
    scales, quants = model_file.q8_0_parts(name)
    row_bytes = cols // 32 * Q8_0_BLOCK_BYTES
    step = max(1, max_bytes // row_bytes)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        yield RowChunk(
            first_row=first,
            quants=np.ascontiguousarray(quants[first:last]).reshape(last - first, cols),
            scales=np.ascontiguousarray(scales[first:last]),
        )
