"""KV-cache formats: how one attention layer's keys and values are stored, as pure numpy codecs (issue 29).

A format is a codec for the keys and one for the values. A codec turns vectors `x [..., head_dim]` into the
arrays a cache stores (`encode`: each array shaped `x.shape[:-1] + trailing`) and back (`decode`: float32),
and says what one vector costs in bytes. The reference backend stores its pages this way (encode on write,
decode on read: the semantics every GPU kernel must reproduce); the GPU's layouts will hold the same codes.

| format | keys / values | bits a value |
|---|---|---|
| `f16` | fp16 | 16 |
| `q8` | int8, an fp16 scale per 32 values (absmax / 127) | 8.5 |
| `tq3` | per 128 values: sign flip, Walsh-Hadamard, 3-bit Lloyd-Max codes, an fp32 scale | 3.25 |
| `q8k-tq3v` | keys q8, values tq3 | 5.875 |

Two more are measurement baselines only (`cmpchat eval`, tests), not formats to run: `naive3`, 3-bit codes with
an fp16 scale per 32 values (3.5 bits), and `q4_0`, llama.cpp's Q4_0 block layout (4.5 bits).

tq3, per block of 128 values x (a head of 256 is two blocks):

1. y = H (s ∘ x) / √128: a fixed sign per position (`TQ3_SIGNS`, seeded, the same for every block, keys and
   values alike), then the Walsh-Hadamard transform (Sylvester order), normalised so the rotation is
   orthonormal. The coordinates of y are close to N(0, ‖x‖²/128) whatever x looked like.
2. u = y · √128 / ‖x‖ (unit variance), and each coordinate's code is its nearest level of the 8-level Lloyd-Max
   quantiser of N(0, 1) (`TQ3_CODEBOOK`).
3. The scale stored (fp32) is ‖x‖ / ‖c‖, c the block's codebook values, so the decoded block keeps the norm of x:
   y' = scale · c, x' = s ∘ (H y' / √128), and ‖x'‖ = ‖y'‖ = ‖x‖.

Attention can stay in the rotated domain, since the rotation R is orthonormal: q · x' = (R q) · y'. The query is
rotated once, scored against y' (the codes through the codebook, times the scale), the values' weighted sum is
taken over their y', and the head's output is rotated back once (`rotate`, `unrotate`).

Stored arrays: 3-bit codes are bit planes, three uint32 words per 32 values (word p holds bit p of the code of
value i in its bit i), so 32 lanes that read the same three words each find their own code; q4_0 keeps
llama.cpp's byte order (byte j of a block: value j in the low nibble, value j + 16 in the high one).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache

import numpy as np

from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig

Stored = tuple[np.ndarray, ...]
"""What a codec stores for vectors [..., head_dim]: arrays shaped [..., *trailing]."""

TQ3_BLOCK = 128
TQ3_SIGN_SEED = 29
"""The seed of tq3's sign flip (numpy's default generator); the signs are pinned in the tests."""


# -- the transform ----------------------------------------------------------------------------------


def sylvester_hadamard(n: int) -> np.ndarray:
    """The n × n Hadamard matrix in Sylvester order (n a power of two), entries ±1, float32."""
    if n < 1 or n & (n - 1):
        raise ValueError("a Sylvester Hadamard matrix needs a power-of-two size")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def wht(x: np.ndarray) -> np.ndarray:
    """The normalised Walsh-Hadamard transform over the last axis (a power of two long), by butterflies as a
    kernel would do it: H x / √n with H in Sylvester order. It is its own inverse."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError("the Walsh-Hadamard transform needs a power-of-two length")
    lead = x.shape[:-1]
    y = np.asarray(x, np.float32).reshape(-1, n)
    half = 1
    while half < n:
        pairs = y.reshape(-1, n // (2 * half), 2, half)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2).reshape(-1, n)
        half *= 2
    return (y * np.float32(1 / math.sqrt(n))).reshape(*lead, n)


@cache
def _signs() -> np.ndarray:
    bits = np.random.default_rng(TQ3_SIGN_SEED).integers(0, 2, TQ3_BLOCK)
    signs = np.where(bits == 1, -1.0, 1.0).astype(np.float32)
    signs.flags.writeable = False
    return signs


def tq3_signs() -> np.ndarray:
    """tq3's sign flip: +1 or -1 for each of a block's 128 positions, fixed (seeded)."""
    return _signs()


def rotate(x: np.ndarray) -> np.ndarray:
    """R x per 128-value block of the last axis: the sign flip, then the normalised WHT (orthonormal)."""
    blocks = _blocks(np.asarray(x, np.float32), TQ3_BLOCK)
    return wht(blocks * _signs()).reshape(x.shape)


def unrotate(y: np.ndarray) -> np.ndarray:
    """Rᵀ y per 128-value block: the WHT (its own inverse), then the sign flip."""
    blocks = _blocks(np.asarray(y, np.float32), TQ3_BLOCK)
    return (wht(blocks) * _signs()).reshape(y.shape)


# -- the Lloyd-Max quantiser ------------------------------------------------------------------------


def _phi(t: float) -> float:
    return 0.0 if math.isinf(t) else math.exp(-t * t / 2) / math.sqrt(2 * math.pi)


def _cdf(t: float) -> float:
    return 0.5 * (1 + math.erf(t / math.sqrt(2)))


def gaussian_centroid(a: float, b: float) -> float:
    """E[X | a < X < b] for X ~ N(0, 1)."""
    return (_phi(a) - _phi(b)) / (_cdf(b) - _cdf(a))


def lloyd_max_gaussian(levels: int, *, tolerance: float = 1e-13, max_iterations: int = 100_000) -> np.ndarray:
    """The `levels`-level minimum-MSE quantiser of N(0, 1), by Lloyd's iterations on the density: thresholds
    halfway between levels, each level the centroid of its interval. float64, ascending."""
    points = np.array([_cdf_inverse((i + 0.5) / levels) for i in range(levels)])
    for _ in range(max_iterations):
        edges = [-math.inf, *((points[:-1] + points[1:]) / 2), math.inf]
        new = np.array([gaussian_centroid(edges[i], edges[i + 1]) for i in range(levels)])
        if np.abs(new - points).max() < tolerance:
            return new
        points = new
    raise RuntimeError("Lloyd's iterations did not converge")


def _cdf_inverse(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@cache
def _codebook() -> tuple[np.ndarray, np.ndarray]:
    levels = lloyd_max_gaussian(8)
    levels = (levels - levels[::-1]) / 2  # exactly symmetric
    book = levels.astype(np.float32)
    thresholds = ((book[:-1] + book[1:]) / 2).astype(np.float32)
    book.flags.writeable = thresholds.flags.writeable = False
    return book, thresholds


def tq3_codebook() -> np.ndarray:
    """The 8 levels of tq3 (float32, ascending; ±0.2451, ±0.7560, ±1.3440, ±2.1520): code k means level k."""
    return _codebook()[0]


# -- packing ----------------------------------------------------------------------------------------


def pack_bitplanes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., n] (n a multiple of 32, values below 2**bits) as bit planes [..., n/32, bits] uint32: word p
    of group g holds bit p of code 32 g + i in its bit i."""
    groups = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 32)
    weights = np.uint32(1) << np.arange(32, dtype=np.uint32)
    planes = [(((groups >> np.uint32(p)) & np.uint32(1)) * weights).sum(axis=-1, dtype=np.uint32) for p in range(bits)]
    return np.stack(planes, axis=-1)


def unpack_bitplanes(planes: np.ndarray) -> np.ndarray:
    """The codes [..., n] uint8 of bit planes [..., n/32, bits]."""
    lanes = np.arange(32, dtype=np.uint32)
    codes = np.zeros((*planes.shape[:-1], 32), np.uint32)
    for p in range(planes.shape[-1]):
        codes |= ((planes[..., p, None] >> lanes) & np.uint32(1)) << np.uint32(p)
    return codes.astype(np.uint8).reshape(*planes.shape[:-2], -1)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    if x.shape[-1] % size:
        raise ValueError(f"the last axis ({x.shape[-1]}) is not a multiple of {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _signed_max(blocks: np.ndarray) -> np.ndarray:
    """Per block, the value of largest magnitude (the first one on a tie), with its sign."""
    index = np.abs(blocks).argmax(axis=-1)[..., None]
    return np.take_along_axis(blocks, index, axis=-1)[..., 0]


# -- codecs -----------------------------------------------------------------------------------------


class Codec(ABC):
    """How one vector of keys or values is stored."""

    name: str
    block: int
    """Values per block: the head size must be a multiple of it."""
    block_bytes: int
    rotated: bool = False
    """True: attention can run on `decode_rotated`'s values after `rotate`-ing the query (see the module)."""

    def bytes_per_vector(self, dim: int) -> int:
        self.check(dim)
        return dim // self.block * self.block_bytes

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block

    def check(self, dim: int) -> None:
        if dim < self.block or dim % self.block:
            raise CmpchatError(
                f"the {self.name} KV format needs a head size that is a multiple of {self.block}, not {dim}"
            )

    @abstractmethod
    def encode(self, x: np.ndarray) -> Stored:
        """The stored arrays of vectors x [..., dim]."""

    @abstractmethod
    def decode(self, stored: Stored) -> np.ndarray:
        """The float32 vectors [..., dim] the stored arrays mean."""

    def decode_rotated(self, stored: Stored) -> np.ndarray:
        """The vectors in the domain attention reads them in: `rotate(decode(stored))`, made without a transform."""
        return self.decode(stored)

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """A query (or any vector) into the domain of `decode_rotated`."""
        return np.asarray(x, np.float32)

    def unrotate(self, y: np.ndarray) -> np.ndarray:
        """A weighted sum of `decode_rotated` vectors back to the model's domain."""
        return np.asarray(y, np.float32)


class Float(Codec):
    """Values as they are, in fp16 or fp32."""

    block = 1

    def __init__(self, dtype: type) -> None:
        self.dtype = np.dtype(dtype)
        self.name = {2: "f16", 4: "f32"}[self.dtype.itemsize]
        self.block_bytes = self.dtype.itemsize

    def encode(self, x: np.ndarray) -> Stored:
        return (np.asarray(x).astype(self.dtype),)

    def decode(self, stored: Stored) -> np.ndarray:
        return stored[0].astype(np.float32)


class Q8(Codec):
    """int8 codes with an fp16 scale per 32 values: d = fp16(absmax / 127), q = round-half-even(x / d)."""

    name = "q8"
    block = 32
    block_bytes = 34

    def encode(self, x: np.ndarray) -> Stored:
        blocks = _blocks(np.asarray(x, np.float32), self.block)
        scale = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float16)
        d = scale.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(d > 0, np.rint(blocks / d), 0)
        return np.clip(q, -127, 127).astype(np.int8).reshape(np.shape(x)), scale

    def decode(self, stored: Stored) -> np.ndarray:
        codes, scale = stored
        values = _blocks(codes.astype(np.float32), self.block) * scale.astype(np.float32)[..., None]
        return values.reshape(codes.shape)


class SignedMax(Codec):
    """llama.cpp's Q4_0 scheme at `bits` bits: per 32 values m, the value of largest magnitude, d = m / -2^(b-1),
    q = min(2^b - 1, floor(x / d + 2^(b-1) + 0.5)), stored fp16(d); x' = (q - 2^(b-1)) · fp16(d). At 4 bits it
    is Q4_0 with llama.cpp's nibble order; at 3 bits, `naive3` (bit planes). Measurement baselines only."""

    block = 32

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = "q4_0" if bits == 4 else f"naive{bits}"
        self.block_bytes = 2 + 32 * bits // 8

    def encode(self, x: np.ndarray) -> Stored:
        blocks = _blocks(np.asarray(x, np.float32), self.block)
        offset = 1 << (self.bits - 1)
        d = _signed_max(blocks) / np.float32(-offset)
        with np.errstate(divide="ignore"):
            inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        codes = np.minimum((1 << self.bits) - 1, np.floor(blocks * inverse[..., None] + np.float32(offset + 0.5)))
        codes = codes.astype(np.uint8)
        if self.bits == 4:
            packed = (codes[..., :16] | (codes[..., 16:] << np.uint8(4))).reshape(*np.shape(x)[:-1], -1)
        else:
            packed = pack_bitplanes(codes.reshape(np.shape(x)), self.bits)
        return packed, d.astype(np.float16)

    def codes(self, stored: Stored) -> np.ndarray:
        packed, scale = stored
        if self.bits == 4:
            pairs = packed.reshape(*packed.shape[:-1], -1, 16)
            return np.concatenate([pairs & np.uint8(15), pairs >> np.uint8(4)], axis=-1).reshape(*packed.shape[:-1], -1)
        return unpack_bitplanes(packed)

    def decode(self, stored: Stored) -> np.ndarray:
        codes = self.codes(stored)
        scale = stored[1].astype(np.float32)[..., None]
        values = (_blocks(codes.astype(np.float32), self.block) - np.float32(1 << (self.bits - 1))) * scale
        return values.reshape(codes.shape)


class TQ3(Codec):
    """3-bit codes of the rotated block and one fp32 scale per 128 values (the module says how)."""

    name = "tq3"
    block = TQ3_BLOCK
    block_bytes = TQ3_BLOCK * 3 // 8 + 4
    rotated = True

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The codes [..., dim] uint8 (0..7) and the scales [..., dim/128] float32 of vectors x."""
        blocks = _blocks(np.asarray(x, np.float32), self.block)
        y = rotate(blocks)
        norm = np.sqrt(np.square(blocks, dtype=np.float64).sum(axis=-1)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            unit = np.where(norm[..., None] > 0, y * (np.float32(math.sqrt(self.block)) / norm[..., None]), 0)
        book, thresholds = _codebook()
        codes = np.searchsorted(thresholds, unit).astype(np.uint8)
        chosen = book[codes]
        scale = (norm / np.sqrt(np.square(chosen, dtype=np.float64).sum(axis=-1))).astype(np.float32)
        return codes.reshape(np.shape(x)), scale

    def encode(self, x: np.ndarray) -> Stored:
        codes, scale = self.quantize(x)
        return pack_bitplanes(codes, 3), scale

    def decode_rotated(self, stored: Stored) -> np.ndarray:
        planes, scale = stored
        codes = unpack_bitplanes(planes)
        values = _blocks(tq3_codebook()[codes], self.block) * scale[..., None]
        return values.reshape(codes.shape)

    def decode(self, stored: Stored) -> np.ndarray:
        return unrotate(self.decode_rotated(stored))

    def rotate(self, x: np.ndarray) -> np.ndarray:
        return rotate(x)

    def unrotate(self, y: np.ndarray) -> np.ndarray:
        return unrotate(y)


# -- formats ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvFormat:
    name: str
    key: Codec
    value: Codec
    help: str
    baseline: bool = False
    """A measurement baseline (eval, tests), not a format to run."""

    def check(self, head_dim: int) -> None:
        self.key.check(head_dim)
        self.value.check(head_dim)

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes of one token's key and value for one KV head."""
        return self.key.bytes_per_vector(head_dim) + self.value.bytes_per_vector(head_dim)

    def bytes_per_token(self, config: ModelConfig) -> int:
        """KV bytes one context token takes over all attention layers."""
        return len(config.attention_layers) * config.num_kv_heads * self.bytes_per_head(config.head_dim)

    @property
    def bits_per_value(self) -> float:
        return (self.key.bits_per_value + self.value.bits_per_value) / 2


_F16, _Q8, _TQ3 = Float(np.float16), Q8(), TQ3()

F32 = KvFormat("f32", Float(np.float32), Float(np.float32), "fp32 keys and values (the reference's exact cache)")
F16 = KvFormat("f16", _F16, _F16, "fp16 keys and values (16 bits a value)")
FORMATS: dict[str, KvFormat] = {
    f.name: f
    for f in (
        F16,
        KvFormat("q8", _Q8, _Q8, "int8, an fp16 scale per 32 values (8.5 bits)"),
        KvFormat("tq3", _TQ3, _TQ3, "3-bit Walsh-Hadamard-rotated Lloyd-Max codes, a scale per 128 (3.25 bits)"),
        KvFormat("q8k-tq3v", _Q8, _TQ3, "keys q8, values tq3 (5.9 bits)"),
    )
}
"""The formats to run with (`--kv`)."""
BASELINES: dict[str, KvFormat] = {
    f.name: f
    for f in (
        KvFormat("naive3", SignedMax(3), SignedMax(3), "baseline: 3-bit codes, an fp16 scale per 32 (3.5 bits)", True),
        KvFormat("q4_0", SignedMax(4), SignedMax(4), "baseline: llama.cpp's Q4_0 blocks (4.5 bits)", True),
    )
}
"""Measurement baselines (`cmpchat eval` `kv=`, tests): the quality marks compare the formats with them."""


def kv_format(name: str, *, baselines: bool = True) -> KvFormat:
    """The format called `name` (the baselines too, unless `baselines` is False); a one-line error otherwise."""
    known = {**FORMATS, **BASELINES} if baselines else FORMATS
    if name not in known:
        raise CmpchatError(f"unknown KV format '{name}'; choose one of: {', '.join(known)}")
    return known[name]
