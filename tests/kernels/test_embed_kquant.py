"""The 4/5/6-bit embedding gather under the CUDA simulator at tiny shapes: every type's rows bit for bit equal to
the reader's dequantisation, repeated ids, the last row, placed (image) rows left alone, zero rows for ids
outside the matrix, a row wider than a block of threads, and the launcher's checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.kernels.elementwise import PLACED_ROW
from cmpchat.kernels.embed_kquant import embed_kquant
from cmpchat.kernels.gemv_kquant import FORMATS, KQUANT_TYPES, KQuantArrays
from cmpchat.model.dequant import dequantize_rows
from tests.kernels.kquant_reference import random_matrix


def gather(tensor_type: T, ids: list[int], arrays: KQuantArrays, before: np.ndarray) -> np.ndarray:
    """The embedding of `ids` into rows that held `before`."""
    hidden = before.copy()
    embed_kquant(tensor_type, np.array(ids, np.int32), arrays, hidden).run()
    return hidden


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert np.array_equal(actual, expected)
    assert np.array_equal(actual.view(np.uint32), expected.view(np.uint32)), "equal values, different zeros' signs"


def exact_rows(raw: np.ndarray, tensor_type: T, cols: int, ids: list[int]) -> np.ndarray:
    return dequantize_rows(raw[ids], tensor_type, cols)


@pytest.mark.parametrize("tensor_type", KQUANT_TYPES, ids=lambda t: t.name)
def test_every_type_gives_the_readers_rows_bit_for_bit(tensor_type: T) -> None:
    rng = np.random.default_rng(int(tensor_type))
    rows = 5
    cols = 256 if FORMATS[tensor_type].sub_scales else 64
    raw, arrays = random_matrix(rng, tensor_type, rows, cols)
    ids = [3, rows - 1, PLACED_ROW, 0, 3, -1, rows, rows - 1]
    before = np.full((len(ids), cols), np.nan, np.float32)
    before[2] = rng.standard_normal(cols).astype(np.float32)  # the image row copied there before the step
    hidden = gather(tensor_type, ids, arrays, before)

    embedded = [i for i, token in enumerate(ids) if 0 <= token < rows]
    assert_bits_equal(hidden[embedded], exact_rows(raw, tensor_type, cols, [ids[i] for i in embedded]))
    assert np.array_equal(hidden[2].view(np.uint32), before[2].view(np.uint32))
    assert_bits_equal(hidden[[5, 6]], np.zeros((2, cols), np.float32))  # -1 and one past the end


def test_a_row_wider_than_a_block_of_threads() -> None:
    rng = np.random.default_rng(1)
    rows, cols = 3, 768  # 192 words of 4 values: two thread blocks, the second half idle
    raw, arrays = random_matrix(rng, T.Q5_K, rows, cols)
    ids = [2, 0]
    hidden = gather(T.Q5_K, ids, arrays, np.full((2, cols), np.nan, np.float32))
    assert_bits_equal(hidden, exact_rows(raw, T.Q5_K, cols, ids))


def test_the_launcher_refuses_wrong_operands() -> None:
    rng = np.random.default_rng(2)
    _, arrays = random_matrix(rng, T.Q4_K, 2, 256)
    ids = np.zeros(3, np.int32)
    hidden = np.zeros((3, 256), np.float32)
    embed_kquant(T.Q4_K, ids, arrays, hidden)  # the good operands pass
    with pytest.raises(ValueError, match="no 4/5/6-bit embedding for Q8_0"):
        embed_kquant(T.Q8_0, ids, arrays, hidden)
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        embed_kquant(T.Q4_K, ids.astype(np.int64), arrays, hidden)
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        embed_kquant(T.Q4_K, ids.reshape(1, 3), arrays, hidden)
    with pytest.raises(ValueError, match="no token ids"):
        embed_kquant(T.Q4_K, ids[:0], arrays, hidden[:0])
    with pytest.raises(ValueError, match=r"hidden must have shape \(3, 256\)"):
        embed_kquant(T.Q4_K, ids, arrays, np.zeros((3, 512), np.float32))
    with pytest.raises(ValueError, match=r"hidden must have shape \(3, 256\)"):
        embed_kquant(T.Q4_K, ids, arrays, hidden[:2])
    with pytest.raises(ValueError, match="hidden must be a 2-D float32"):
        embed_kquant(T.Q4_K, ids, arrays, hidden.astype(np.float16))
    with pytest.raises(ValueError, match="hidden must be C-contiguous"):
        embed_kquant(T.Q4_K, ids, arrays, np.zeros((256, 3), np.float32).T)
    with pytest.raises(ValueError, match="weight high must have shape"):
        embed_kquant(T.Q5_K, ids, arrays, hidden)  # Q4_K's arrays have no high bits
    with pytest.raises(ValueError, match="whole blocks of 256"):
        embed_kquant(T.Q6_K, ids[:1], random_matrix(rng, T.Q4_0, 2, 64)[1], hidden[:1, :64])
    with pytest.raises(ValueError, match="weight nibbles must be a 2-D uint32"):
        embed_kquant(T.Q4_K, ids, replace(arrays, nibbles=arrays.nibbles.view(np.int32)), hidden)
