"""The CUDA backend on the oracle models as llama-quantize writes them (tests/fixtures/oracle/quantized.json:
Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K matrices mixed with Q8_0 ones and F32) against the reference backend in
GPU-mirroring mode, on a GPU (`pytest -m gpu`), every prompt of the oracle on every file of `real_heads`: the
other models' GDN heads (16 wide) are narrower than the CUDA kernels' 32.

Tolerance as test_kquant_weights.py's for its Q4_K_M mix: the mirroring reference rounds the activations of the
4/5/6-bit matmuls to int8 as the GPU does, so the two differ in fp32 summation order only, max |dlogit| within
2e-3 of the largest logit. Over 150-token prompts a near tie can flip with that order, so top-1 tokens are
compared where the reference's margin between its first and second choice exceeds 0.1 (test_cuda_backend_gpu.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cmpchat.backends.base import Backend
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile

pytestmark = pytest.mark.gpu

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle"
FILES = [
    name for name, entry in json.loads((ORACLE / "quantized.json").read_text())["files"].items()
    if entry["model"] == "real_heads"
]  # fmt: skip
MANIFEST = json.loads((ORACLE / "manifest.json").read_text())
PROMPTS = {name: prompt["ids"] for name, prompt in MANIFEST["prompts"].items()}
CONTEXT = 256  # holds the longest prompt (153 tokens)
CLEAR_MARGIN = 0.1


@pytest.fixture(scope="module", params=FILES)
def backends(request: pytest.FixtureRequest) -> tuple[CudaBackend, ReferenceBackend]:
    model_file = ModelFile(ORACLE / request.param)
    gpu = CudaBackend(model_file, sequences=1, saved_states=0, context=CONTEXT, kv_tokens=CONTEXT)
    return gpu, ReferenceBackend(model_file, mirror_gpu=True)


def score(backend: Backend[Any], ids: list[int]) -> np.ndarray:
    sequence = backend.new_sequence()
    logits = backend.score(sequence, ids)
    backend.release(sequence)
    return logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_backend_matches_the_mirroring_reference(backends, prompt) -> None:
    gpu, reference = backends
    got, expected = score(gpu, PROMPTS[prompt]), score(reference, PROMPTS[prompt])
    error = np.abs(got - expected).max() / np.abs(expected).max()
    print(f"{reference.model_file.path.name} {prompt}: max |dlogit| / max |logit| {error:.2e}")
    assert error <= 2e-3
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > CLEAR_MARGIN
    assert np.array_equal(got[clear].argmax(axis=1), expected[clear].argmax(axis=1))
