"""Dequantisation of every block type against the `gguf` package's own, bit for bit, on random valid blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.model import dequant
from cmpchat.model.dequant import BLOCK_FORMATS, READABLE_TYPES, dequantize_blocks, dequantize_rows, row_bytes
from cmpchat.model.gguf_file import ModelFile
from tests.model.test_gguf_file import write_gguf

FP16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}
"""Byte offsets of each block's fp16 fields (d, and the minimum or dmin)."""


def random_blocks(tensor_type: T, count: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes are valid blocks of these types once their fp16 fields are finite: every bit pattern but
    inf/NaN, so normal, subnormal and signed-zero scales all occur."""
    block = BLOCK_FORMATS[tensor_type]
    blocks = rng.integers(0, 256, (count, block.nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[tensor_type]:
        bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # exponent 31 (inf/NaN) -> 15
        bits[:8] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF]  # zeros, subnormals, ±1, ±max
        blocks[:, offset : offset + 2] = bits[:, None].view(np.uint8)
    return blocks


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(theirs, dtype=np.float32).view(np.uint32))


def test_every_block_type_has_ggml_sizes():
    assert set(FP16_FIELDS) == set(BLOCK_FORMATS)
    for tensor_type, block in BLOCK_FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[tensor_type] == (block.values, block.nbytes)


@pytest.mark.parametrize("tensor_type", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_blocks_equal_gguf_bit_for_bit(tensor_type):
    rng = np.random.default_rng(int(tensor_type))
    blocks = random_blocks(tensor_type, 4096, rng)
    ours = dequantize_blocks(blocks, tensor_type)
    same_bits(ours, gguf.quants.dequantize(blocks, tensor_type).reshape(ours.shape))
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("tensor_type", list(BLOCK_FORMATS), ids=lambda t: t.name)
def test_rows_larger_than_a_chunk_equal_gguf(tensor_type):
    block = BLOCK_FORMATS[tensor_type]
    cols = 2 * 256
    rows = 2 * dequant.CHUNK_VALUES // cols + 3  # several chunks and a partial one
    rng = np.random.default_rng(1)
    raw = random_blocks(tensor_type, rows * cols // block.values, rng).reshape(rows, row_bytes(tensor_type, cols))
    same_bits(dequantize_rows(raw, tensor_type, cols), gguf.quants.dequantize(raw, tensor_type))


def test_q4_k_scales_of_the_upper_sub_blocks_take_the_top_bits_of_the_first_bytes():
    """The one irregular part of Q4_K / Q5_K: sub-blocks 4-7 put the top 2 bits of their 6-bit scale and min
    in the top bits of bytes 0-3 and 4-7. Built by hand: only sub-block 5 has a scale (0b110001 = 49, low nibble
    1 in byte 9, top bits 0b11 in byte 1) and only sub-block 6 a min (0b100010 = 34: nibble 2, top bits 0b10)."""
    block = np.zeros((1, 144), dtype=np.uint8)
    block[0, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d
    block[0, 2:4] = np.array([0.5], dtype=np.float16).view(np.uint8)  # dmin
    scales = block[0, 4:16]
    scales[9] = 0x01  # sub-block 5: scale low nibble
    scales[1] = 0xC0  # sub-block 5: scale top bits (byte 1 = sub-block 1's scale byte, which stays 0)
    scales[10] = 0x20  # sub-block 6: min low nibble (high nibble of byte 10)
    scales[6] = 0x80  # sub-block 6: min top bits (byte 6 = sub-block 2's min byte)
    block[0, 16:144] = 0x53  # every low nibble 3, every high nibble 5
    values = dequantize_blocks(block, T.Q4_K).reshape(8, 32)
    expected = np.zeros((8, 32), dtype=np.float32)
    expected[5] = 49 * 5  # sub-block 5 = high nibbles of group 2
    expected[6] = -0.5 * 34  # sub-block 6 has scale 0, min 34
    np.testing.assert_array_equal(values, expected)
    same_bits(values.reshape(1, 256), gguf.quants.dequantize(block, T.Q4_K))


def test_q5_0_high_bit_j_belongs_to_value_j():
    block = np.zeros((1, 22), dtype=np.uint8)
    block[0, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[0, 2:6] = np.array([(1 << 3) | (1 << 20)], dtype="<u4").view(np.uint8)
    values = dequantize_blocks(block, T.Q5_0)[0]
    expected = np.full(32, -16.0, dtype=np.float32)
    expected[[3, 20]] = 0.0
    np.testing.assert_array_equal(values, expected)


def test_q6_k_value_order_and_scales():
    """Value e of a Q6_K block takes scale e // 16; its 4 low bits and 2 high bits come from the bytes the
    module's docstring lists. One nonzero 6-bit value per 32-value group shows the order."""
    block = np.zeros((1, 210), dtype=np.uint8)
    block[0, 208:210] = np.array([0.25], dtype=np.float16).view(np.uint8)
    block[0, 192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)  # scale of sub-block s is s + 1
    low, high = block[0, 0:128], block[0, 128:192]
    for half in range(2):
        low[64 * half + 1] = 0x0F | (0x07 << 4)  # value 1 of group 0 (low nibble), value 1 of group 2 (high)
        low[64 * half + 32 + 2] = 0x0A  # value 2 of group 1
        high[32 * half + 1] = 0b00_11_00_01  # group 0 bits 0-1 = 1, group 2 bits 4-5 = 3
    values = dequantize_blocks(block, T.Q6_K)[0]
    expected = np.full(256, -32.0, dtype=np.float32)
    for half in range(2):
        expected[128 * half + 1] = 0x1F - 32  # 15 | 1 << 4
        expected[128 * half + 64 + 1] = 0x37 - 32  # 7 | 3 << 4
        expected[128 * half + 32 + 2] = 0x0A - 32
    expected *= 0.25 * (np.arange(256) // 16 + 1)
    np.testing.assert_array_equal(values, expected.astype(np.float32))


@pytest.fixture
def block_type_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A file with one [5, 512] tensor of every block type, and each tensor's raw bytes."""
    rng = np.random.default_rng(3)
    raws = {}
    for tensor_type, block in BLOCK_FORMATS.items():
        raws[tensor_type.name] = random_blocks(tensor_type, 5 * 512 // block.values, rng).reshape(5, -1)
    path = write_gguf(tmp_path / "blocks.gguf", {name: (raw, T[name]) for name, raw in raws.items()})
    return path, raws


def test_a_file_of_every_type_reads_exactly(block_type_file):
    path, raws = block_type_file
    model_file = ModelFile(path)
    for name, raw in raws.items():
        info = model_file.tensor_info(name)
        assert info.shape == (5, 512) and info.type_name == name
        expected = gguf.quants.dequantize(raw, T[name])
        same_bits(model_file.dequantize(name), expected)
        same_bits(model_file.dequantize(name, rows=np.array([4, 0, 4])), expected[[4, 0, 4]])
        same_bits(model_file.dequantize(name, rows=slice(1, 3)), expected[1:3])


def test_type_mix_counts_tensors_and_bytes(block_type_file):
    path, raws = block_type_file
    mix = ModelFile(path).type_mix()
    assert {(t.name, count, nbytes) for t, count, nbytes in mix} == {(n, 1, raw.nbytes) for n, raw in raws.items()}
    assert [nbytes for _, _, nbytes in mix] == sorted((nbytes for _, _, nbytes in mix), reverse=True)


def test_readable_types_are_the_floats_and_the_block_types():
    assert set(READABLE_TYPES) == {T.F32, T.F16, T.BF16} | set(BLOCK_FORMATS)
