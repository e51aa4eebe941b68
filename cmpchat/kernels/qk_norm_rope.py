"""Per-head q/k RMSNorm + partial IMROPE for one decode token per row, fused with the KV-cache write.

Input: the fp32 fused q/k/v projection output, one row per sequence, width 2*H*hd + 2*Hkv*hd, laid out as
the concatenation of attn_q, attn_k and attn_v outputs (docs/model.md, "Gated attention layer"):
    [ q_0 | gate_0 | q_1 | gate_1 | ... | q_{H-1} | gate_{H-1} | k_0 | ... | k_{Hkv-1} | v_0 | ... | v_{Hkv-1} ]
each piece hd values. The gates stay in place: the attention combine reads them from this buffer.

Per row, with (cache_index, t, h, w) = decode_positions[row] read on the device (see attention.py):
- q_out[row, head] = rope(rms_norm(q_head, q_norm_weight)), fp32;
- K cache at cache_index, KV head g = fp16(rope(rms_norm(k_g, k_norm_weight))), V cache = fp16(v_g);
- rows with an out-of-range cache_index are skipped (inactive rows of a captured batch).
For a compressed cache `qk_norm_rope_rows` writes the fp32 keys to a [B, Hkv, hd] buffer instead, for
`kv_write` to quantise (with the values, which it reads from qkv).

RoPE rotates the first rope_dims dims of each head, NeoX half-split pairs (i, i + rope_dims/2). Frequency i
takes position column `freq_axis[i]` (0 t, 1 h, 2 w: the IMROPE rule, built on the host by `rope_tables`)
and angle float32(float64(position) * inv_freq[i]): the same rounding as the reference `rope_angles`. An fp32
product would be up to ~0.03 rad off at 256K positions; one fp64 multiply per frequency costs nothing here.

One block of hd threads per (query or KV head, row): thread d owns dim d. The sum of squares is a warp
butterfly then a pass over the per-warp sums in shared memory; the rotation partner d +- rope_dims/2 comes
through shared memory. The whole step moves a few KB per row, so it is launch-bound, not bandwidth-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, float64

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import WARP_SIZE, allow_dependent_grids, block_sum_f32, wait_for_prior_grids
from cmpchat.cudart.launch import Launch, check_array
from cmpchat.kernels.attention import POSITION_COLUMNS, check_kv_cache, check_row_inputs

MAX_HEAD_DIM = 1024  # one thread per dim


@dataclass(frozen=True)
class RopeTables:
    """Per rotated frequency: inverse frequency (float64) and which position column it uses (int32)."""

    inv_freq: np.ndarray
    freq_axis: np.ndarray


def rope_tables(rope_dims: int, theta: float, sections: tuple[int, ...]) -> RopeTables:
    """IMROPE tables (docs/model.md, "RoPE and M-RoPE"): frequency i uses h when i % 3 == 1 and i < 3*sections[1], w when
    i % 3 == 2 and i < 3*sections[2], else t; inv_freq_i = theta^(-2i/rope_dims), as the reference."""
    if rope_dims % 2 or rope_dims < 2:
        raise ValueError(f"rope_dims must be even and positive, got {rope_dims}")
    index = np.arange(rope_dims // 2)
    inv_freq = (theta ** (-2.0 * index / rope_dims)).astype(np.float64)
    axis = np.zeros(rope_dims // 2, dtype=np.int32)
    axis[(index % 3 == 1) & (index < 3 * sections[1])] = 1
    axis[(index % 3 == 2) & (index < 3 * sections[2])] = 2
    return RopeTables(inv_freq, axis)


@cuda.jit(device=True, inline=True)
def _normed_roped(qkv, positions, q_norm, k_norm, inv_freq, freq_axis, eps, head, row, dim, num_heads, head_dim):
    """Dim `dim` of query head `head` (KV head `head` - H when that is >= 0) of `row`, normed and rotated."""
    kv_head = head - num_heads
    if kv_head < 0:
        x = qkv[row, 2 * head * head_dim + dim]
        weight = q_norm[dim]
    else:
        x = qkv[row, (2 * num_heads + kv_head) * head_dim + dim]
        weight = k_norm[dim]
    # Reference order: x * rsqrt(mean(x^2) + eps), then * weight.
    mean_square = block_sum_f32(x * x) / float32(head_dim)
    y = x * (float32(1) / math.sqrt(mean_square + eps)) * weight

    normed = cuda.shared.array(MAX_HEAD_DIM, float32)
    normed[dim] = y
    cuda.syncthreads()
    half = inv_freq.shape[0]
    if dim < 2 * half:
        i = dim if dim < half else dim - half
        angle = float32(float64(positions[row, 1 + freq_axis[i]]) * inv_freq[i])
        cos, sin = math.cos(angle), math.sin(angle)
        if dim < half:
            y = y * cos - normed[dim + half] * sin
        else:
            y = y * cos + normed[dim - half] * sin
    return y


@kernel(
    "void(float32[:, ::1], int32[:, ::1], int32[:, ::1], float32[::1], float32[::1], float64[::1], int32[::1], "
    "float32, float32[:, :, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1])",
    early_launch=True,
)
def qk_norm_rope(qkv, positions, page_table, q_norm, k_norm, inv_freq, freq_axis, eps, q_out, k_cache, v_cache):
    wait_for_prior_grids()
    allow_dependent_grids()
    head, row, dim = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    page_tokens, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cache_index = positions[row, 0]
    if cache_index < 0 or cache_index >= page_table.shape[1] * page_tokens:
        return
    y = _normed_roped(qkv, positions, q_norm, k_norm, inv_freq, freq_axis, eps, head, row, dim, num_heads, head_dim)
    kv_head = head - num_heads
    if kv_head < 0:
        q_out[row, head, dim] = y
    else:
        page = page_table[row, cache_index // page_tokens]
        slot = cache_index % page_tokens
        k_cache[page, slot, kv_head, dim] = y
        v_cache[page, slot, kv_head, dim] = qkv[row, (2 * num_heads + num_kv_heads + kv_head) * head_dim + dim]


@kernel(
    "void(float32[:, ::1], int32[:, ::1], float32[::1], float32[::1], float64[::1], int32[::1], float32, "
    "float32[:, :, ::1], float32[:, :, ::1])",
    early_launch=True,
)
def qk_norm_rope_rows(qkv, positions, q_norm, k_norm, inv_freq, freq_axis, eps, q_out, k_rows):
    """`qk_norm_rope` for a compressed cache: the keys go to k_rows [B, Hkv, hd] (for `kv_write`), every row
    (the write and the attention skip inactive ones)."""
    wait_for_prior_grids()
    allow_dependent_grids()
    head, row, dim = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    y = _normed_roped(qkv, positions, q_norm, k_norm, inv_freq, freq_axis, eps, head, row, dim, num_heads, head_dim)
    if head < num_heads:
        q_out[row, head, dim] = y
    else:
        k_rows[row, head - num_heads, dim] = y


def qk_norm_rope_launch(
    qkv: Any,
    decode_positions: Any,
    page_table: Any,
    q_norm_weight: Any,
    k_norm_weight: Any,
    inv_freq: Any,
    freq_axis: Any,
    eps: float,
    q_out: Any,
    k_cache: Any,
    v_cache: Any,
) -> Launch:
    """The launch that normalises and rotates q and k of one decode step and caches the new K and V.

    qkv fp32 [B, 2*H*hd + 2*Hkv*hd] (layout in the module docstring); decode_positions int32 [B, 4];
    page_table int32 [B, pages]; norm weights fp32 [hd]; inv_freq float64 / freq_axis int32 [rope_dims/2]
    from `rope_tables`, copied to the device once; q_out fp32 [B, H, hd]; caches fp16
    [pages, page_tokens, Hkv, hd] (attention.py).
    """
    batch, num_heads, head_dim = check_array(q_out, "q_out", np.float32, 3)
    _, _, num_kv_heads, _ = check_kv_cache(k_cache, v_cache, head_dim)
    check_row_inputs(decode_positions, page_table, batch)
    _check_inputs(qkv, q_norm_weight, k_norm_weight, inv_freq, freq_axis, batch, num_heads, num_kv_heads, head_dim)
    tables = (q_norm_weight, k_norm_weight, inv_freq, freq_axis, np.float32(eps))
    return Launch(
        qk_norm_rope,
        (num_heads + num_kv_heads, batch),
        head_dim,
        (qkv, decode_positions, page_table, *tables, q_out, k_cache, v_cache),
    )


def qk_norm_rope_rows_launch(
    qkv: Any,
    positions: Any,
    q_norm_weight: Any,
    k_norm_weight: Any,
    inv_freq: Any,
    freq_axis: Any,
    eps: float,
    q_out: Any,
    k_rows: Any,
) -> Launch:
    """As `qk_norm_rope_launch`, for a compressed cache: the normed and rotated keys go to k_rows fp32
    [B, Hkv, hd], which `kv_write.kv_write_launch` quantises into the cache."""
    batch, num_heads, head_dim = check_array(q_out, "q_out", np.float32, 3)
    _, num_kv_heads, _ = check_array(k_rows, "k_rows", np.float32, 3)
    check_array(k_rows, "k_rows", np.float32, 3, (batch, num_kv_heads, head_dim))
    check_array(positions, "positions", np.int32, 2, (batch, POSITION_COLUMNS))
    _check_inputs(qkv, q_norm_weight, k_norm_weight, inv_freq, freq_axis, batch, num_heads, num_kv_heads, head_dim)
    tables = (q_norm_weight, k_norm_weight, inv_freq, freq_axis, np.float32(eps))
    return Launch(
        qk_norm_rope_rows, (num_heads + num_kv_heads, batch), head_dim, (qkv, positions, *tables, q_out, k_rows)
    )


def _check_inputs(
    qkv: Any,
    q_norm_weight: Any,
    k_norm_weight: Any,
    inv_freq: Any,
    freq_axis: Any,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    check_array(qkv, "qkv", np.float32, 2, (batch, 2 * (num_heads + num_kv_heads) * head_dim))
    check_array(q_norm_weight, "q_norm_weight", np.float32, 1, (head_dim,))
    check_array(k_norm_weight, "k_norm_weight", np.float32, 1, (head_dim,))
    (half,) = check_array(inv_freq, "inv_freq", np.float64, 1)
    check_array(freq_axis, "freq_axis", np.int32, 1, (half,))
    if 2 * half > head_dim:
        raise ValueError(f"{2 * half} rotated dims exceed the head size {head_dim}")
    if head_dim % WARP_SIZE or head_dim > MAX_HEAD_DIM or num_heads % num_kv_heads:
        raise ValueError(f"unsupported heads: H={num_heads}, Hkv={num_kv_heads}, hd={head_dim}")
