"""Benchmarks: model files of the released shapes, decode speed against the read limit, llama.cpp."""
