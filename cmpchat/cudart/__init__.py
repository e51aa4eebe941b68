"""The CUDA engine's kernels (Numba-CUDA, no tensor cores) and the Numba-specific pieces they need.

`intrinsics` (inline PTX with simulator fallbacks) and `compile` (the kernel registry) are the only
Numba-specific parts besides launching; `kernels/` holds one module per kernel family.
"""
