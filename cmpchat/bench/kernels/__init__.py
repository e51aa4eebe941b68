"""Kernel micro-benchmarks (each a `python -m` command line) beside the model benchmarks."""
