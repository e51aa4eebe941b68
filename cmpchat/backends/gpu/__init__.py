"""The CUDA backend: the model on one GPU through Numba-CUDA kernels, decode captured as a CUDA graph."""
