"""The KV-cache codecs (cmpchat/kv_formats.py): sizes, round trips, tq3's transform, codebook and scale, and
the two measurement baselines' exact layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cmpchat import kv_formats as kvf
from cmpchat.errors import CmpchatError
from cmpchat.kv_formats import BASELINES, FORMATS, Q8, TQ3, SignedMax

ALL = {**FORMATS, **BASELINES}
CODECS = {c.name: c for f in ALL.values() for c in (f.key, f.value)}


def vectors(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Keys-like data: Gaussian, with a few channels much larger than the rest (as RoPE'd keys have)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., ::37] *= 8
    return x


# -- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "head_bytes", "bits"),
    [("f16", 1024, 16), ("q8", 544, 8.5), ("tq3", 208, 3.25), ("q8k-tq3v", 376, 5.875), ("naive3", 224, 3.5),
     ("q4_0", 288, 4.5)],
)  # fmt: skip
def test_bytes_per_token_match_the_issue_table(name, head_bytes, bits):
    fmt = ALL[name]
    assert fmt.bytes_per_head(256) == head_bytes and fmt.bits_per_value == bits
    # 9B: 8 attention layers x 4 KV heads of 256 (issue 29's table: 32,768 / 17,408 / 6,656 / 12,032 B a token)
    assert 8 * 4 * fmt.bytes_per_head(256) == {"f16": 32768, "q8": 17408, "tq3": 6656, "q8k-tq3v": 12032}.get(
        name, 8 * 4 * head_bytes
    )


@pytest.mark.parametrize("name", sorted(CODECS))
def test_what_is_stored_is_what_the_format_counts(name):
    codec = CODECS[name]
    x = vectors((5, 3, 256))
    stored = codec.encode(x)
    assert all(a.shape[:2] == (5, 3) for a in stored)
    assert sum(a.nbytes for a in stored) == 15 * codec.bytes_per_vector(256)


def test_head_sizes_must_be_a_multiple_of_the_block():
    assert TQ3().bytes_per_vector(384) == 3 * 52 and Q8().bytes_per_vector(96) == 3 * 34
    for codec, dim in [(TQ3(), 192), (TQ3(), 64), (Q8(), 48), (SignedMax(4), 16)]:
        with pytest.raises(CmpchatError, match=f"multiple of {codec.block}, not {dim}"):
            codec.check(dim)
    with pytest.raises(CmpchatError, match="unknown KV format 'tq2'; choose one of: f16, q8, tq3, q8k-tq3v$"):
        kvf.kv_format("tq2", baselines=False)
    assert kvf.kv_format("q4_0") is BASELINES["q4_0"] and all(f.baseline for f in BASELINES.values())


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dim", [256, 384])
def test_round_trips_and_zeros(name, dim):
    codec = CODECS[name]
    x = vectors((4, 2, dim), seed=dim)
    decoded = codec.decode(codec.encode(x))
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    relative = np.linalg.norm(decoded - x) / np.linalg.norm(x)
    # fp16 rounding; int8; 3-bit rotated (Lloyd-Max's 0.186 on Gaussians, whatever the outliers); 3 and 4 bits
    # per 32 values, whose steps the outlier channels widen
    assert relative < {"f16": 1e-3, "q8": 0.02, "tq3": 0.2, "naive3": 0.4, "q4_0": 0.2}[name]
    assert np.array_equal(codec.decode(codec.encode(x)), decoded)  # deterministic
    zeros = codec.decode(codec.encode(np.zeros_like(x)))
    assert np.array_equal(zeros, np.zeros_like(x))  # a fresh page reads as zeros, no NaN from a zero scale


def test_the_rotation_makes_outliers_harmless():
    x = vectors((16, 256), seed=12)
    error = {n: np.linalg.norm(CODECS[n].decode(CODECS[n].encode(x)) - x) for n in ("tq3", "naive3")}
    assert error["tq3"] < 0.7 * error["naive3"]  # at fewer bits (3.25 against 3.5)


def test_q8_rounds_to_the_nearest_step_of_its_fp16_scale():
    x = vectors((64, 256), seed=3)
    codes, scale = Q8().encode(x)
    assert codes.dtype == np.int8 and scale.dtype == np.float16 and scale.shape == (64, 8)
    blocks = x.reshape(64, 8, 32)
    assert np.array_equal(scale, (np.abs(blocks).max(axis=-1) / 127).astype(np.float16))
    d = scale.astype(np.float32)[..., None]
    error = np.abs(Q8().decode((codes, scale)).reshape(64, 8, 32) - blocks)
    assert np.all(error <= d / 2 * (1 + 1e-6) + 1e-3 * np.abs(blocks).max(axis=-1, keepdims=True))


def q4_0_llama_cpp(block: np.ndarray) -> tuple[bytes, np.float16]:
    """llama.cpp's quantize_row_q4_0_ref for one block of 32, transcribed line by line."""
    amax, vmax = 0.0, 0.0
    for v in block:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = np.float32(vmax) / np.float32(-8)
    inverse = np.float32(1) / d if d else np.float32(0)
    out = bytearray(16)
    for j in range(16):
        x0, x1 = np.float32(block[j]) * inverse, np.float32(block[16 + j]) * inverse
        xi0, xi1 = min(15, int(x0 + np.float32(8.5))), min(15, int(x1 + np.float32(8.5)))
        out[j] = xi0 | (xi1 << 4)
    return bytes(out), np.float16(d)


def test_q4_0_is_llama_cpps_block_layout():
    x = vectors((6, 64), seed=4)
    x[0, :32] = 0  # an all-zero block: scale 0, codes 8
    packed, scale = SignedMax(4).encode(x)
    assert packed.dtype == np.uint8 and packed.shape == (6, 32) and scale.shape == (6, 2)
    for row in range(6):
        for b in range(2):
            qs, d = q4_0_llama_cpp(x[row, 32 * b : 32 * b + 32])
            assert packed[row, 16 * b : 16 * b + 16].tobytes() == qs and scale[row, b] == d
    nibbles = np.concatenate([packed[:, :16] & 15, packed[:, :16] >> 4], axis=1)  # dequantize_row_q4_0
    assert np.array_equal(
        SignedMax(4).decode((packed, scale))[:, :32], (nibbles - 8.0) * scale[:, :1].astype(np.float32)
    )


def test_naive3_is_the_same_rule_at_three_bits():
    x = vectors((8, 256), seed=5)
    codec = SignedMax(3)
    packed, scale = codec.encode(x)
    blocks = x.reshape(8, 8, 32)
    index = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, index, axis=-1)[..., 0] / np.float32(-4)
    assert np.array_equal(scale, d.astype(np.float16))
    codes = codec.codes((packed, scale)).reshape(8, 8, 32)
    expected = np.minimum(7, np.floor(blocks / d[..., None] + np.float32(4.5)))
    assert codes.max() <= 7 and np.mean(codes == expected) > 0.999  # x * (1/d) and x / d may round apart
    error = np.abs(codec.decode((packed, scale)).reshape(8, 8, 32) - blocks)
    assert np.all(error <= np.abs(scale.astype(np.float32))[..., None] * 1.001)  # half a step; a step at the top


def test_bit_planes_hold_code_i_in_bit_i():
    rng = np.random.default_rng(6)
    codes = rng.integers(0, 8, (3, 64)).astype(np.uint8)
    planes = kvf.pack_bitplanes(codes, 3)
    assert planes.dtype == np.uint32 and planes.shape == (3, 2, 3)
    for i in range(64):
        word = planes[:, i // 32]
        got = sum(((word[:, p] >> (i % 32)) & 1) << p for p in range(3))
        assert np.array_equal(got, codes[:, i])
    assert np.array_equal(kvf.unpack_bitplanes(planes), codes)


# -- tq3: the transform -----------------------------------------------------------------------------


def test_the_walsh_hadamard_transform_is_orthonormal_and_its_own_inverse():
    h = kvf.sylvester_hadamard(128).astype(np.float64) / math.sqrt(128)
    assert np.allclose(h @ h.T, np.eye(128), atol=1e-12) and np.array_equal(h, h.T)
    x = vectors((10, 128), seed=7)
    assert np.allclose(kvf.wht(x), x @ h.T, atol=1e-5)  # the butterflies are the Sylvester matrix
    assert np.allclose(kvf.wht(kvf.wht(x)), x, atol=1e-5)


def test_the_sign_flip_is_fixed():
    signs = kvf.tq3_signs()
    assert signs.shape == (128,) and set(np.unique(signs)) == {-1.0, 1.0} and not signs.flags.writeable
    bits = np.packbits(signs < 0, bitorder="little")
    # Pinned: the GPU kernels and any cache written before must see the same signs (seed TQ3_SIGN_SEED = 29).
    assert bits.tobytes().hex() == EXPECTED_SIGN_BITS
    assert np.array_equal(np.random.default_rng(kvf.TQ3_SIGN_SEED).integers(0, 2, 128) == 1, signs < 0)


EXPECTED_SIGN_BITS = "6d05a13b8612af91a7c189ffd4e05a01"


def test_the_rotation_keeps_norms_and_dot_products():
    x, q = vectors((6, 256), seed=8), vectors((6, 256), seed=9)
    rx, rq = kvf.rotate(x), kvf.rotate(q)
    assert np.allclose(np.linalg.norm(rx.reshape(6, 2, 128), axis=-1), np.linalg.norm(x.reshape(6, 2, 128), axis=-1))
    assert np.allclose((rx * rq).sum(-1), (x * q).sum(-1), rtol=1e-5, atol=1e-3)
    assert np.allclose(kvf.unrotate(rx), x, atol=1e-5)
    # The rotated coordinates of spiky data are close to Gaussian: no coordinate far out.
    spiky = np.zeros((1, 128), np.float32)
    spiky[0, 5] = 1.0
    assert np.abs(kvf.rotate(spiky)).max() == pytest.approx(1 / math.sqrt(128))


# -- tq3: codebook and scale ------------------------------------------------------------------------

LLOYD_MAX_3_BIT = [0.2451, 0.7560, 1.3440, 2.1520]  # Max (1960), table I, N = 8
"""The published optimal levels of an 8-level quantiser of N(0, 1) (the positive half)."""


def test_the_codebook_is_the_lloyd_max_quantiser_of_a_unit_gaussian():
    book = kvf.tq3_codebook().astype(np.float64)
    assert book.shape == (8,) and np.all(np.diff(book) > 0) and np.array_equal(book, -book[::-1])
    assert np.allclose(book[4:], LLOYD_MAX_3_BIT, atol=1e-4)
    # Centroid condition: each level is the mean of N(0, 1) over the values nearest to it (thresholds halfway).
    edges = [-math.inf, *((book[:-1] + book[1:]) / 2), math.inf]
    for i, level in enumerate(book):
        assert kvf.gaussian_centroid(edges[i], edges[i + 1]) == pytest.approx(level, abs=1e-6)
    # Its distortion is Max's 0.03455, and moving any level either way makes it worse.
    assert distortion(book) == pytest.approx(0.034548, abs=1e-5)
    for i in range(8):
        for step in (-1e-3, 1e-3):
            moved = book.copy()
            moved[i] += step
            assert distortion(moved) > distortion(book)
    assert np.allclose(kvf.lloyd_max_gaussian(2), [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)])


def distortion(levels: np.ndarray) -> float:
    """E[(X - Q(X))²] for X ~ N(0, 1) and nearest-level quantisation, by quadrature."""
    t = np.linspace(-9, 9, 100_001)
    density = np.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    nearest = levels[np.abs(t[:, None] - levels[None, :]).argmin(axis=1)]
    return float(np.trapezoid((t - nearest) ** 2 * density, t))


def test_tq3_codes_are_the_nearest_levels_of_the_normalised_rotated_block():
    x = vectors((20, 256), seed=10)
    codes, scale = TQ3().quantize(x)
    blocks = x.reshape(20, 2, 128)
    norm = np.linalg.norm(blocks, axis=-1)
    unit = kvf.rotate(blocks) * (math.sqrt(128) / norm[..., None])
    book = kvf.tq3_codebook()
    nearest = np.abs(unit[..., None] - book).argmin(axis=-1)
    assert np.mean(codes.reshape(20, 2, 128) == nearest) > 0.999  # a tie in fp32 may go either way
    assert 0.03 < np.mean((unit - book[nearest]) ** 2) < 0.045  # about Lloyd-Max's 0.0345 on Gaussians


def test_tq3_keeps_the_norm_of_each_block():
    x = vectors((30, 256), seed=11)
    codec = TQ3()
    codes, scale = codec.quantize(x)
    norm = np.linalg.norm(x.reshape(30, 2, 128), axis=-1)
    chosen = np.linalg.norm(kvf.tq3_codebook()[codes].reshape(30, 2, 128), axis=-1)
    assert np.allclose(scale * chosen, norm, rtol=1e-6)  # the scale is ||x|| / ||x_hat_unit|| ...
    # ... not ||x|| (||x|| / sqrt(128) a unit coordinate): the quantised unit vector is shorter, by sqrt(1 - D) on
    # average, D = 0.0345 the codebook's distortion, so the scale is that much larger
    gaussian = np.random.default_rng(13).standard_normal((200, 128)).astype(np.float32)
    _, gaussian_scale = codec.quantize(gaussian)
    ratio = gaussian_scale[:, 0] * math.sqrt(128) / np.linalg.norm(gaussian, axis=-1)
    assert np.mean(ratio) == pytest.approx(1 / math.sqrt(1 - 0.034548), abs=0.003)
    decoded = codec.decode(codec.encode(x))
    assert np.allclose(np.linalg.norm(decoded.reshape(30, 2, 128), axis=-1), norm, rtol=1e-5)
    rotated = codec.decode_rotated(codec.encode(x))
    assert np.allclose(rotated, kvf.rotate(decoded), atol=1e-5)  # the codes through the codebook, times the scale
