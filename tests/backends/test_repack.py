"""GPU weight layout: quants and scales apart, in bounded row chunks, exactly the file's values."""

from __future__ import annotations

import numpy as np

from cmpchat.backends.gpu.repack import q8_0_row_chunks
from cmpchat.model.gguf_file import ModelFile


def test_chunks_reassemble_the_matrix_exactly(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    name = "blk.0.ffn_gate.weight"  # [96, 64]
    chunks = list(q8_0_row_chunks(model_file, name, max_bytes=5 * 68))
    assert [c.first_row for c in chunks[:3]] == [0, 5, 10]
    quants = np.concatenate([c.quants for c in chunks])
    scales = np.concatenate([c.scales for c in chunks])
    assert quants.shape == (96, 64) and quants.dtype == np.int8 and quants.flags.c_contiguous
    assert scales.shape == (96, 2) and scales.dtype == np.float16
    values = (quants.reshape(96, 2, 32) * scales.astype(np.float32)[..., None]).reshape(96, 64)
    np.testing.assert_array_equal(values, model_file.dequantize(name))
