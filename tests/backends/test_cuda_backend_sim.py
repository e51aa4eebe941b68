"""The whole CUDA decode step under Numba's CUDA simulator, on the tiny model, against the reference
backend in GPU-mirroring mode. The simulator runs the kernels' Python bodies with the intrinsics'
fallbacks (no inline PTX, no warp shuffles) and replays "graphs" launch by launch; the GPU tests run the
same comparison on real hardware at real head sizes, and batched decode there (too slow simulated)."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile

TOKENS = [72, 33]  # two steps: the second reads the first one's KV cache and recurrent state


@pytest.fixture(scope="module")
def backends(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    return CudaBackend(model_file, context=256), ReferenceBackend(model_file, mirror_gpu=True)


@pytest.mark.slow
def test_decode_matches_the_mirroring_reference(backends):
    gpu, reference = backends
    expected = reference.prefill(reference.new_sequence(), TOKENS, all_logits=True)
    sequence = gpu.new_sequence()
    got = gpu.prefill(sequence, TOKENS, all_logits=True)
    gpu.release(sequence)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-3 * scale
    assert np.array_equal(got.argmax(axis=1), expected.argmax(axis=1))
