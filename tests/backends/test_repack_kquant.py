"""The 4/5/6-bit GPU layout holds exactly the file's values: the layout read back in numpy
(`tests/kernels/kquant_reference.py`, which reads it as the kernels do) equals the reader's dequantisation bit
for bit, for random valid blocks of every type; the streamed chunks of a file's matrix equal it repacked
whole; and the layout's byte count is what the memory plan counts."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.gpu.repack import kquant_row_chunks, repack_kquant
from cmpchat.kernels.gemv_kquant import FORMATS, KQUANT_TYPES
from cmpchat.model.builder import build_model, random_blocks
from cmpchat.model.dequant import dequantize_rows
from cmpchat.model.gguf_file import ModelFile
from tests.conftest import WIDE_SHAPE, add_byte_vocabulary
from tests.kernels.kquant_reference import decode_repacked


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_the_layout_reads_back_as_the_readers_values(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type))
    rows, cols = 3, 512
    raw = random_blocks(rng, tensor_type, rows, cols)
    arrays = repack_kquant(raw, tensor_type, cols)
    values, _ = decode_repacked(arrays, tensor_type, cols)
    expected = dequantize_rows(raw, tensor_type, cols)
    assert np.array_equal(values.view(np.uint32), expected.view(np.uint32))
    shapes = FORMATS[tensor_type].shapes(rows, cols)
    for name, shape in shapes.items():
        array = getattr(arrays, name)
        assert array.shape == shape and array.flags.c_contiguous
    stored = sum(getattr(arrays, name).nbytes for name, shape in shapes.items() if shape[0] == rows)
    assert stored == FORMATS[tensor_type].matrix_bytes(rows, cols)


def test_streamed_chunks_equal_the_matrix_repacked_whole(tmp_path) -> None:
    path = tmp_path / "mix.gguf"
    name = "blk.0.ffn_gate.weight"
    build_model(path, WIDE_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=None, mix={name: T.Q5_K})
    model = ModelFile(path)
    info = model.tensor_info(name)
    whole = repack_kquant(model.raw_rows(name), info.type, info.shape[1])
    chunks = list(kquant_row_chunks(model, name, max_bytes=3 * model.raw_rows(name).shape[1]))
    assert len(chunks) == -(-info.shape[0] // 3)
    for array in ("nibbles", "high", "sub_scales", "scales"):
        joined = np.concatenate([getattr(chunk.arrays, array) for chunk in chunks])
        assert np.array_equal(joined, getattr(whole, array))
    assert [chunk.first_row for chunk in chunks] == list(range(0, info.shape[0], 3))
