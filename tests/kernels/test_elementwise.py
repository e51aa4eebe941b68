"""The Q8_0 embedding gather against the reference (simulator at small sizes, `-m gpu` at real ones)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.kernels.elementwise import PLACED_ROW, embed_q8_0
from cmpchat.model.gguf_file import ModelFile
from cmpchat.model.quant import q8_0_dequantize, q8_0_quantize, q8_0_split


def repacked_q8_0(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0 bytes of float rows split the way the engine stores weights: (quants as words, fp16 scales, exact)."""
    rows, cols = values.shape
    scales, quants = q8_0_split(q8_0_quantize(values), rows, cols)
    words = np.ascontiguousarray(quants).reshape(rows, cols).view(np.uint32)
    return words, np.ascontiguousarray(scales), q8_0_dequantize(scales, quants)


def gather(token_ids: list[int], words: np.ndarray, scales: np.ndarray, before: np.ndarray | None = None) -> np.ndarray:
    """The embedding of `token_ids` into rows that held `before` (default NaNs)."""
    if before is None:
        before = np.full((len(token_ids), 4 * words.shape[1]), np.nan, np.float32)
    hidden = cuda.to_device(before)
    embed_q8_0(
        cuda.to_device(np.array(token_ids, np.int32)), cuda.to_device(words), cuda.to_device(scales), hidden
    ).run()
    return hidden.copy_to_host()


def test_embedding_rows_are_exact_and_negative_ids_give_zeros():
    rng = np.random.default_rng(0)
    words, scales, exact = repacked_q8_0((rng.standard_normal((50, 96)) * 3).astype(np.float32))
    ids = [7, 49, 0, -1, 7]
    hidden = gather(ids, words, scales)
    np.testing.assert_array_equal(hidden[[0, 1, 2, 4]], exact[[7, 49, 0, 7]])
    np.testing.assert_array_equal(hidden[3], 0)


def test_placed_rows_keep_the_hidden_state_copied_there():
    rng = np.random.default_rng(1)
    words, scales, exact = repacked_q8_0(rng.standard_normal((20, 64)).astype(np.float32))
    image_rows = rng.standard_normal((4, 64)).astype(np.float32)
    hidden = gather([3, PLACED_ROW, PLACED_ROW, 11], words, scales, before=image_rows)
    np.testing.assert_array_equal(hidden[[0, 3]], exact[[3, 11]])
    np.testing.assert_array_equal(hidden[1:3], image_rows[1:3])


def test_embedding_matches_a_gguf_file(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    scales, quants = model_file.q8_0_parts("token_embd.weight")
    vocab, blocks, _ = quants.shape
    words = np.ascontiguousarray(quants).reshape(vocab, blocks * 32).view(np.uint32)
    ids = np.array([3, 258, 0, 100])
    hidden = gather(list(ids), words, np.ascontiguousarray(scales))
    np.testing.assert_array_equal(hidden, model_file.dequantize("token_embd.weight", rows=ids))


def test_launcher_rejects_wrong_arrays():
    words = np.zeros((4, 16), np.uint32)
    scales = np.zeros((4, 2), np.float16)
    hidden = np.zeros((2, 64), np.float32)
    ids = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="scales must be a 2-D float16"):
        embed_q8_0(ids, words, scales.astype(np.float32), hidden)
    with pytest.raises(ValueError, match="hidden must have shape"):
        embed_q8_0(ids, words, scales, hidden[:, :32])
    with pytest.raises(ValueError, match="multiple of 32"):
        embed_q8_0(ids, np.zeros((4, 12), np.uint32), scales, hidden)
    with pytest.raises(ValueError, match="token_ids must be a 1-D int32"):
        embed_q8_0(ids.reshape(1, 2), words, scales, hidden)


@pytest.mark.gpu
def test_real_size_embedding_gather():
    rng = np.random.default_rng(2)
    words, scales, exact = repacked_q8_0(rng.standard_normal((4096, 5120)).astype(np.float32))
    ids = rng.integers(0, 4096, 16)
    np.testing.assert_array_equal(gather(list(ids), words, scales), exact[ids])
