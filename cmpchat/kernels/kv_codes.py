"""How the GPU stores a compressed KV format's codes (issue 29): the arrays of a page, the tq3 packing, and the
constants and device helpers the write and attention kernels share.

The codes are those of `cmpchat.kv_formats` (bit for bit: `kv_write`); only tq3's packing differs from the
reference's bit planes. Per attention layer, keys and values each take two arrays, token-major like the fp16
pages ([pages, page_tokens, Hkv, n]):

| codec | codes | scales |
|---|---|---|
| `q8` | int8 [.., hd]: value d in byte d | fp16 [.., hd/32]: one per 32 values |
| `tq3` | uint32 [.., 3 hd/32]: value d's 3-bit code at bits 3d..3d+2 of the vector's bit string | fp32 [.., hd/128] |

tq3's bit string: bit b of a vector's codes is bit b % 32 of its word b // 32 (fields straddle words). A decode
lane owns 8 consecutive dims 8c..8c+7 (one 16-byte chunk of an fp16 row); their 24 bits start at bit 24c, so
the lane funnels its one or two words into 24 bits once per token and then finds each code with a shift and a
mask, where bit planes would cost 3 shifts and 3 merges a value. The bytes are the format's: 52 per 128 values
(3.25 bits), 104 per vector of 256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from cmpchat.cudart.launch import check_array
from cmpchat.kv_formats import TQ3_BLOCK, tq3_codebook, tq3_signs

Q8_BLOCK = 32
LANE_VALUES = 8  # dims a decode lane owns
TQ3_BITS = 3


@dataclass(frozen=True)
class CodeArrays:
    """What one codec stores per vector of `head_dim` values on the GPU: codes and scales."""

    name: str
    code_dtype: type
    scale_dtype: type
    values_per_scale: int
    code_bits: int

    def codes_per_vector(self, head_dim: int) -> int:
        """Elements of the codes array per vector."""
        return head_dim * self.code_bits // (8 * np.dtype(self.code_dtype).itemsize)

    def scales_per_vector(self, head_dim: int) -> int:
        return head_dim // self.values_per_scale

    def bytes_per_vector(self, head_dim: int) -> int:
        return (
            self.codes_per_vector(head_dim) * np.dtype(self.code_dtype).itemsize
            + self.scales_per_vector(head_dim) * np.dtype(self.scale_dtype).itemsize
        )

    def check(self, head_dim: int) -> None:
        if head_dim % self.values_per_scale or head_dim % LANE_VALUES or head_dim // LANE_VALUES > 32:
            raise ValueError(f"the GPU's {self.name} codes need a head size of one warp's lanes x 8 values, "
                             f"a multiple of {self.values_per_scale}, not {head_dim}")  # fmt: skip


Q8_CODES = CodeArrays("q8", np.int8, np.float16, Q8_BLOCK, 8)
TQ3_CODES = CodeArrays("tq3", np.uint32, np.float32, TQ3_BLOCK, TQ3_BITS)
CODECS = {codes.name: codes for codes in (Q8_CODES, TQ3_CODES)}
GPU_FORMATS: dict[str, tuple[CodeArrays, CodeArrays]] = {
    "q8": (Q8_CODES, Q8_CODES),
    "tq3": (TQ3_CODES, TQ3_CODES),
    "q8k-tq3v": (Q8_CODES, TQ3_CODES),
}
"""The compressed formats of `kv_formats.FORMATS` the GPU runs: (keys, values)."""

# tq3's constants as kv_formats makes them (the thresholds by the same float32 arithmetic).
TQ3_BOOK = np.array(tq3_codebook(), np.float32)
TQ3_THRESHOLDS = ((TQ3_BOOK[:-1] + TQ3_BOOK[1:]) / np.float32(2)).astype(np.float32)
TQ3_SIGNS = np.array(tq3_signs(), np.float32)
INV_SQRT_BLOCK = float32(1 / math.sqrt(TQ3_BLOCK))
SQRT_BLOCK = float32(math.sqrt(TQ3_BLOCK))


@cuda.jit(device=True, inline=True)
def tq3_lane_bits(words, base, chunk):
    """The 24 code bits of dims 8 chunk .. 8 chunk + 7 of the vector whose codes start at words[base]."""
    bit = 24 * chunk
    word = base + (bit >> 5)
    shift = bit & 31
    low = uint64(words[word])
    high = uint64(0)
    if shift > 8:  # the field runs into the next word
        high = uint64(words[word + 1])
    return uint32(((high << uint64(32)) | low) >> uint64(shift)) & uint32(0xFFFFFF)


@cuda.jit(device=True, inline=True)
def q8_value(word, i):
    """Signed byte i (0..3) of a word of int8 codes, as fp32."""
    byte = int32((word >> uint32(8 * i)) & uint32(0xFF))  # int32: `int()` of a uint32 stays unsigned on the GPU
    return float32(byte - ((byte & 0x80) << 1))


def check_caches(caches: tuple[Any, ...], format_name: str, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Raise ValueError unless `caches` are the four arrays (key codes, key scales, value codes, value scales)
    of the `format_name` format for Hkv heads of `head_dim`, all [pages, page_tokens, Hkv, n]; (pages,
    page_tokens)."""
    if format_name not in GPU_FORMATS:
        raise ValueError(f"no GPU kernels for the KV format '{format_name}'; they exist for {', '.join(GPU_FORMATS)}")
    if len(caches) != 4:
        raise ValueError(f"a compressed cache is 4 arrays (codes and scales of keys and values), got {len(caches)}")
    pages, page_tokens = caches[0].shape[:2]
    for codec, role, (codes, scales) in zip(
        GPU_FORMATS[format_name], ("k", "v"), (caches[:2], caches[2:]), strict=True
    ):
        codec.check(head_dim)
        lead = (pages, page_tokens, num_kv_heads)
        check_array(codes, f"{role}_codes", codec.code_dtype, 4, (*lead, codec.codes_per_vector(head_dim)))
        check_array(scales, f"{role}_scales", codec.scale_dtype, 4, (*lead, codec.scales_per_vector(head_dim)))
    return int(pages), int(page_tokens)
