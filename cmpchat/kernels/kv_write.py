"""The KV-cache write of a compressed format (issue 29): each row's new key and value, quantised into its page.

Rows are tokens, one per row of `positions` / `page_table` as in `qk_norm_rope` (attention.py): a decode step's
sequences or a prompt chunk's tokens. Per row: the key is `k_rows[row, g]` (after norm and RoPE), the value
KV head g's slice of the fused projection output `qkv` (its last Hkv*hd columns); a row whose cache_index is out
of range writes nothing. One block of hd threads per (KV head, row, key or value); thread d owns dim d.

The codes are `cmpchat.kv_formats`' bit for bit (`tests/kernels/test_kv_write.py`), packed as `kv_codes` says:

- q8: the block's absmax in fp32, the scale fp16(absmax / 127), the codes rint(x / scale) (half to even).
- tq3, per 128 values: the sign flip and the Walsh-Hadamard butterflies in shared memory in the reference's
  order (stride 1 first, a + b and a - b, then times 1/sqrt(128)), so the rotated values are equal; the norm
  and the codebook's norm are float64 sums in numpy's pairwise order for 128 values (8 running sums of every
  8th square, then ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))), so the scale is equal too. The code is
  the count of thresholds below the unit value, as `searchsorted`.

The write moves a few hundred bytes a row and runs about 30 barriers: launch-bound, like `qk_norm_rope`.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from numba import cuda, float32, float64, int8, types, uint32, uint64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import allow_dependent_grids, wait_for_prior_grids
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.attention import check_row_inputs
from cmpchat.kernels.kv_codes import (
    GPU_FORMATS,
    INV_SQRT_BLOCK,
    Q8_BLOCK,
    SQRT_BLOCK,
    TQ3_BOOK,
    TQ3_SIGNS,
    TQ3_THRESHOLDS,
    CodeArrays,
    check_caches,
)
from cmpchat.kv_formats import TQ3_BLOCK

MAX_HEAD_DIM = 256
_PAIRWISE_LANES = 8  # numpy's pairwise sum of up to 128 values: 8 running sums
_LANE_SUMS = MAX_HEAD_DIM // TQ3_BLOCK * _PAIRWISE_LANES  # a shared array's size must be one constant


@cuda.jit(device=True, inline=True)
def _numpy_sum_f64(values, lanes, block, i):
    """The sum of values[128 block .. 128 block + 127] in numpy's order (float64 `sum` of 128 contiguous
    values), for thread i of the block's 128; every thread of the launch block calls it together."""
    cuda.syncthreads()
    if i < _PAIRWISE_LANES:
        total = values[block * TQ3_BLOCK + i]
        for k in range(1, TQ3_BLOCK // _PAIRWISE_LANES):
            total += values[block * TQ3_BLOCK + k * _PAIRWISE_LANES + i]
        lanes[block * _PAIRWISE_LANES + i] = total
    cuda.syncthreads()
    r = block * _PAIRWISE_LANES
    total = ((lanes[r] + lanes[r + 1]) + (lanes[r + 2] + lanes[r + 3])) + (
        (lanes[r + 4] + lanes[r + 5]) + (lanes[r + 6] + lanes[r + 7])
    )
    cuda.syncthreads()  # lanes free again
    return total


@cuda.jit(device=True)
def _encode_tq3(x, dim, codes, scales, page, slot, head):
    head_dim = cuda.blockDim.x
    block, i = dim // TQ3_BLOCK, dim % TQ3_BLOCK
    rotated = cuda.shared.array(MAX_HEAD_DIM, float32)
    squares = cuda.shared.array(MAX_HEAD_DIM, float64)
    lanes = cuda.shared.array(_LANE_SUMS, float64)
    fields = cuda.shared.array(MAX_HEAD_DIM, uint32)
    rotated[dim] = x * TQ3_SIGNS[i]
    squares[dim] = float64(x) * float64(x)
    cuda.syncthreads()
    half = 1
    while half < TQ3_BLOCK:
        mine, partner = rotated[dim], rotated[dim ^ half]
        cuda.syncthreads()
        rotated[dim] = mine + partner if i & half == 0 else partner - mine
        cuda.syncthreads()
        half *= 2
    norm = float32(math.sqrt(_numpy_sum_f64(squares, lanes, block, i)))
    unit = float32(0)
    if norm > 0:
        unit = rotated[dim] * INV_SQRT_BLOCK * (SQRT_BLOCK / norm)
    code = 0
    for t in range(TQ3_THRESHOLDS.shape[0]):
        if TQ3_THRESHOLDS[t] < unit:
            code += 1
    level = float64(TQ3_BOOK[code])
    squares[dim] = level * level
    fields[dim] = uint32(code)
    chosen = _numpy_sum_f64(squares, lanes, block, i)  # its barriers publish `fields` too
    if i == 0:
        scales[page, slot, head, block] = float32(float64(norm) / math.sqrt(chosen))
    if dim < codes.shape[3]:  # word `dim` of the bit string: the fields that touch bits 32 dim .. 32 dim + 31
        packed = uint64(0)
        for value in range(32 * dim // 3, min((32 * dim + 31) // 3 + 1, head_dim)):
            shift = 3 * value - 32 * dim
            if shift >= 0:
                packed |= uint64(fields[value]) << uint64(shift)
            else:
                packed |= uint64(fields[value]) >> uint64(-shift)
        codes[page, slot, head, dim] = uint32(packed & uint64(0xFFFFFFFF))


@cuda.jit(device=True)
def _encode_q8(x, dim, codes, scales, page, slot, head):
    magnitudes = cuda.shared.array(MAX_HEAD_DIM, float32)
    magnitudes[dim] = abs(x)
    cuda.syncthreads()
    block = dim // Q8_BLOCK
    top = float32(0)
    for k in range(Q8_BLOCK):
        top = max(top, magnitudes[block * Q8_BLOCK + k])
    scale = types.float16(top / float32(127))
    step = float32(scale)
    code = 0
    if step > 0:
        code = min(127, max(-127, round(x / step)))
    codes[page, slot, head, dim] = int8(code)
    if dim % Q8_BLOCK == 0:
        scales[page, slot, head, block] = scale


_ENCODERS = {"q8": _encode_q8, "tq3": _encode_tq3}


def _signature(key: CodeArrays, value: CodeArrays) -> str:
    arrays = ", ".join(
        f"{np.dtype(dtype).name}[:, :, :, ::1]"
        for dtype in (key.code_dtype, key.scale_dtype, value.code_dtype, value.scale_dtype)
    )
    return f"void(float32[:, :, ::1], float32[:, ::1], int32[:, ::1], int32[:, ::1], {arrays})"


@cache
def _write_kernel(format_name: str) -> Any:
    key, value = GPU_FORMATS[format_name]
    encode_key, encode_value = _ENCODERS[key.name], _ENCODERS[value.name]

    def kv_write(k_rows, qkv, positions, page_table, k_codes, k_scales, v_codes, v_scales):
        wait_for_prior_grids()
        allow_dependent_grids()
        kv_head, row, part = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        dim = cuda.threadIdx.x
        num_kv_heads, head_dim = k_rows.shape[1], k_rows.shape[2]
        page_tokens = k_codes.shape[1]
        cache_index = positions[row, 0]
        if cache_index < 0 or cache_index >= page_table.shape[1] * page_tokens:
            return
        page = page_table[row, cache_index // page_tokens]
        slot = cache_index % page_tokens
        if part == 0:
            encode_key(k_rows[row, kv_head, dim], dim, k_codes, k_scales, page, slot, kv_head)
        else:  # value head g: columns width - (Hkv - g) hd onwards
            x = qkv[row, qkv.shape[1] - (num_kv_heads - kv_head) * head_dim + dim]
            encode_value(x, dim, v_codes, v_scales, page, slot, kv_head)

    name = "kv_write_" + format_name.replace("-", "_")
    kv_write.__name__ = kv_write.__qualname__ = name
    return kernel(_signature(key, value), early_launch=True)(kv_write)


for _name in GPU_FORMATS:  # registered now so the PTX check sees them
    _write_kernel(_name)


def kv_write_launch(
    k_rows: Any, qkv: Any, positions: Any, page_table: Any, caches: tuple[Any, ...], format_name: str
) -> Launch:
    """The launch that quantises each row's new key and value into the `format_name` cache (`kv_codes.GPU_FORMATS`).

    k_rows fp32 [B, Hkv, hd]: the keys after norm and RoPE. qkv fp32 [B, 2*H*hd + 2*Hkv*hd]: the fused
    projection output (the values are its last Hkv*hd columns). positions int32 [B, 4], page_table int32
    [B, pages]. caches: (key codes, key scales, value codes, value scales), each [pages, page_tokens, Hkv, n]
    (`kv_codes`; `KvPages.caches` of a compressed layout).
    """
    batch, num_kv_heads, head_dim = check_array(k_rows, "k_rows", np.float32, 3)
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the KV write takes head sizes up to {MAX_HEAD_DIM}, not {head_dim}")
    check_caches(caches, format_name, num_kv_heads, head_dim)
    check_row_inputs(positions, page_table, batch)
    _, width = check_array(qkv, "qkv", np.float32, 2)
    if width % (2 * head_dim) or width <= 2 * num_kv_heads * head_dim:
        raise ValueError(f"qkv has {width} columns: not 2*H*hd + 2*Hkv*hd for hd {head_dim}, Hkv {num_kv_heads}")
    check_array(qkv, "qkv", np.float32, 2, (batch, width))
    return Launch(
        _write_kernel(format_name), (num_kv_heads, batch, 2), head_dim, (k_rows, qkv, positions, page_table, *caches)
    )
