"""The compressed KV write (`kernels/kv_write.py`) under the simulator against `cmpchat.kv_formats`' codecs: the
codes and the scales bit for bit, in the slots the rows name and nowhere else."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.kernels.kv_codes import GPU_FORMATS, CodeArrays
from cmpchat.kernels.kv_write import kv_write_launch
from cmpchat.kv_formats import FORMATS, TQ3, Codec

PAGE_TOKENS = 8
SENTINEL_CODES = 0x5A


def unpack_tq3_words(words: np.ndarray) -> np.ndarray:
    """The codes [..., hd] of tq3 words [..., 3 hd / 32] (`kv_codes`: value d at bits 3d..3d+2)."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")
    return (bits.reshape(*words.shape[:-1], -1, 3) * np.array([1, 2, 4], np.uint8)).sum(axis=-1, dtype=np.uint8)


def pack_tq3_words(codes: np.ndarray) -> np.ndarray:
    """The inverse of `unpack_tq3_words`."""
    bits = ((codes[..., None] >> np.arange(3, dtype=np.uint8)) & 1).astype(np.uint8)
    packed = np.packbits(bits.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")
    return packed.view(np.uint32)


def empty_caches(format_name: str, pages: int, num_kv_heads: int, head_dim: int) -> list[np.ndarray]:
    """Host pages of the format filled with a sentinel, so untouched slots can be seen."""
    arrays: list[np.ndarray] = []
    for codec in GPU_FORMATS[format_name]:
        lead = (pages, PAGE_TOKENS, num_kv_heads)
        codes: np.ndarray = np.full((*lead, codec.codes_per_vector(head_dim)), SENTINEL_CODES, codec.code_dtype)
        arrays += [codes, np.full((*lead, codec.scales_per_vector(head_dim)), np.nan, codec.scale_dtype)]
    return arrays


def reference_codes(codec: Codec, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the reference stores for x, as (codes one per value, scales)."""
    if isinstance(codec, TQ3):
        return codec.quantize(x)
    codes, scales = codec.encode(x)
    return codes, scales


def stored_codes(codes: CodeArrays, stored: np.ndarray) -> np.ndarray:
    return unpack_tq3_words(stored) if codes.name == "tq3" else stored


def write(format_name: str, k_rows: np.ndarray, qkv: np.ndarray, positions: np.ndarray, table: np.ndarray,
          caches: list[np.ndarray]) -> list[np.ndarray]:  # fmt: skip
    device = [cuda.to_device(a) for a in caches]
    k, q, p, t = (cuda.to_device(a) for a in (k_rows, qkv, positions, table))
    kv_write_launch(k, q, p, t, tuple(device), format_name).run()
    return [a.copy_to_host() for a in device]


def test_tq3_packing_round_trips() -> None:
    codes = np.random.default_rng(0).integers(0, 8, (3, 256)).astype(np.uint8)
    words = pack_tq3_words(codes)
    assert words.shape == (3, 24)
    assert words[0, 0] & 7 == codes[0, 0] and (words[0, 0] >> 30) | ((words[0, 1] & 1) << 2) == codes[0, 10]
    np.testing.assert_array_equal(unpack_tq3_words(words), codes)


@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
@pytest.mark.parametrize("head_dim", [128, 256])
def test_write_matches_the_reference_codecs(format_name: str, head_dim: int) -> None:
    rng = np.random.default_rng(head_dim)
    num_heads, num_kv_heads, pages = 2, 2, 6
    # Rows: sequence 0 at tokens 5 and 6 (a prompt chunk's rows), an inactive row, sequence 2 at token 17.
    positions = np.array([[5, 5, 5, 5], [-1, 0, 0, 0], [6, 6, 6, 6], [17, 17, 17, 17]], np.int32)
    table = np.array([[4, 1, 0], [2, 3, 5], [4, 1, 0], [2, 3, 5]], np.int32)
    scale = np.exp(rng.uniform(-4, 4, (4, num_kv_heads, 1)))  # magnitudes over 8 binades
    k_rows = (rng.standard_normal((4, num_kv_heads, head_dim)) * scale).astype(np.float32)
    k_rows[0, 1] = 0  # a zero key: scale 0
    k_rows[2, 0, :32] = 0  # a zero q8 block
    qkv = (rng.standard_normal((4, 2 * (num_heads + num_kv_heads) * head_dim)) * 3).astype(np.float32)
    values = qkv[:, -num_kv_heads * head_dim :].reshape(4, num_kv_heads, head_dim)
    caches = empty_caches(format_name, pages, num_kv_heads, head_dim)
    out = write(format_name, k_rows, qkv, positions, table, caches)

    reference = FORMATS[format_name]
    written = np.zeros((pages, PAGE_TOKENS), bool)
    for row in (0, 2, 3):
        token = positions[row, 0]
        page, slot = table[row, token // PAGE_TOKENS], token % PAGE_TOKENS
        written[page, slot] = True
        for part, (codec, x) in enumerate(((reference.key, k_rows[row]), (reference.value, values[row]))):
            codes, scales = reference_codes(codec, x)
            gpu = GPU_FORMATS[format_name][part]
            np.testing.assert_array_equal(stored_codes(gpu, out[2 * part][page, slot]), codes, f"row {row} {part}")
            got = out[2 * part + 1][page, slot]
            expected: np.ndarray = scales.astype(gpu.scale_dtype)
            np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), expected.view(f"u{got.itemsize}"))
    for before, after in zip(caches, out, strict=True):
        np.testing.assert_array_equal(after[~written], before[~written])


def test_launcher_rejects_bad_arguments() -> None:
    caches = tuple(empty_caches("tq3", 2, 1, 128))
    k_rows, qkv = np.zeros((1, 1, 128), np.float32), np.zeros((1, 4 * 128), np.float32)
    positions, table = np.zeros((1, 4), np.int32), np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="no GPU kernels for the KV format 'f16'"):
        kv_write_launch(k_rows, qkv, positions, table, caches, "f16")
    with pytest.raises(ValueError, match="k_codes must be a 4-D int8"):
        kv_write_launch(k_rows, qkv, positions, table, caches, "q8")
    with pytest.raises(ValueError, match="multiple of 128, not 64"):
        kv_write_launch(np.zeros((1, 1, 64), np.float32), qkv, positions, table, caches, "tq3")
    with pytest.raises(ValueError, match="qkv has 384 columns"):
        kv_write_launch(k_rows, qkv[:, :384], positions, table, caches, "tq3")
