"""The 4/5/6-bit embedding gather on a GPU (`pytest -m gpu`) at a real width: every type's 4096 x 4096 matrix,
64 ids with repeats, the last row, a placed (image) row and an idle id, bit for bit against the reader."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.kernels.elementwise import PLACED_ROW
from cmpchat.kernels.embed_kquant import embed_kquant
from cmpchat.kernels.gemv_kquant import KQUANT_TYPES
from tests.kernels.kquant_reference import random_matrix
from tests.kernels.q8_reference import device
from tests.kernels.test_embed_kquant import assert_bits_equal, exact_rows
from tests.kernels.test_gemv_kquant_gpu import on_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_every_type_at_a_real_width(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type) + 11)
    rows = cols = 4096
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    ids = rng.integers(0, rows, 64).astype(np.int32)
    ids[1], ids[9], ids[20], ids[33], ids[40] = rows - 1, ids[0], PLACED_ROW, -1, rows - 1
    before = rng.standard_normal((len(ids), cols)).astype(np.float32)
    hidden = device(before)
    embed_kquant(tensor_type, device(ids), on_device(arrays), hidden).run()
    result = hidden.copy_to_host()

    embedded = np.flatnonzero(ids >= 0)
    assert_bits_equal(result[embedded], exact_rows(raw, tensor_type, cols, list(ids[embedded])))
    assert_bits_equal(result[20], before[20])
    assert_bits_equal(result[33], np.zeros(cols, np.float32))
