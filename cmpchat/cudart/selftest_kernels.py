"""Small kernels that exercise the intrinsics and the launch paths, for the GPU self-test.

They are registered like engine kernels, so the PTX check (compute_70, no tensor cores, no spills) and
the SASS check cover the intrinsics' inline PTX even before any engine kernel exists. Each has a
one-line numpy meaning, stated in its docstring, that the self-test compares against.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32

from cmpchat.cudart.compile import kernel
from cmpchat.cudart.intrinsics import dp4a, fma_f32, load_u32x4, shfl_xor_f32, warp_max_f32, warp_sum_f32, warp_sum_i32


@kernel("void(int32[::1], int32[::1], int32[::1], int32[::1])")
def dp4a_words(a, b, accumulate, out):
    """out[i] = accumulate[i] + Σ signed bytes of a[i] × b[i]."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = dp4a(a[i], b[i], accumulate[i])


@kernel("void(float32[::1], float32[::1], float32[::1], int32[::1], float32[::1])")
def warp_reductions(x, sums, maxes, lane_sums, partners):
    """Per warp of 32: sums = Σx, maxes = max x, lane_sums = Σ global index, partners[i] = x[i ^ 5].

    Launch with a whole number of warps per block: every lane takes part in each shuffle.
    """
    i = cuda.grid(1)
    value = x[i]
    sums[i] = warp_sum_f32(value)
    maxes[i] = warp_max_f32(value)
    lane_sums[i] = warp_sum_i32(np.int32(i))
    partners[i] = shfl_xor_f32(value, 5)


@kernel("void(uint32[::1], uint32[:, ::1], int64)")
def load_words(words, out, start):
    """out[i, :] = words[start + 4 i : start + 4 i + 4], one 16-byte load each (start a multiple of 4)."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        w0, w1, w2, w3 = load_u32x4(words, start + 4 * i)
        out[i, 0] = w0
        out[i, 1] = w1
        out[i, 2] = w2
        out[i, 3] = w3


@kernel("void(float32[:, ::1], float32[:, :], int32[::1], float32, int64, float16, boolean, int8, uint16, float64)")
def mixed_arguments(source, target, position, scale, offset, half, negate, small, unsigned, wide):
    """target = ±(source × scale + offset + position[0] + half + small + unsigned + wide), − when negate.

    One argument of each kind the raw launcher packs: a C-contiguous and an any-layout 2-d array, a
    device scalar, and scalars of seven types.
    """
    row, col = cuda.grid(2)
    if row < target.shape[0] and col < target.shape[1]:
        shift = float32(offset + position[0]) + float32(half) + float32(small) + float32(unsigned) + float32(wide)
        value = source[row, col] * scale + shift
        target[row, col] = -value if negate else value


@kernel("void(float32[::1], float32[::1])")
def reverse_in_shared(source, target):
    """target = source[::-1], staged through dynamic shared memory of 4 × source.size bytes (one block)."""
    staging = cuda.shared.array(0, float32)
    n = source.size
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        staging[i] = source[i]
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        target[i] = staging[n - 1 - i]


@kernel("void(float32[::1], int32[::1], float32)")
def add_at_position(values, position, amount):
    """values[position[0]] += amount (the position is read when the kernel runs: graph replays see updates)."""
    if cuda.grid(1) == 0:
        values[position[0]] += amount


@kernel("void(float32[::1], float32)")
def scale_all(values, factor):
    """values *= factor."""
    i = cuda.grid(1)
    if i < values.size:
        values[i] *= factor


@kernel("void(int32[::1])")
def count_launch(counter):
    """counter[0] += 1: a near-empty kernel for launch overhead, whose count proves every launch ran."""
    if cuda.grid(1) == 0:
        counter[0] += 1


@kernel("void(float32[::1], float32[::1], float32[::1], float32[::1])")
def fma_values(a, b, c, out):
    """out = a * b + c rounded once (`intrinsics.fma_f32_exact`)."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = fma_f32(a[i], b[i], c[i])
