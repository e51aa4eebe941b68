"""The CUDA backend with a compressed KV cache on a GPU (`pytest -m gpu`), on the oracle model (real head sizes:
hd 256, two 128-value tq3 blocks a head): a 600-token prompt (two long-prompt steps over the codes and a tail in
16-row chunks) and three decode steps, against the reference backend in GPU-mirroring mode with the same format
and rotated attention; and the format really is in use (its logits differ from the fp16 cache's).

Tolerance: the two sides hold codes of keys that differ in fp32 summation order, so a value near a code boundary
can take the neighbouring code, and this random model amplifies such steps: the reference itself moves by up to
1.8% of its largest logit when its input is scaled by 1 + 1e-6 (`test_cuda_backend_gpu.py`'s measurement). H200,
2026-12-04: 0.69-0.82% per format at most over the four rows. Bound: 2%."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cmpchat.backends.base import Backend
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.kernels.kv_codes import GPU_FORMATS
from cmpchat.model.gguf_file import ModelFile

pytestmark = pytest.mark.gpu

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle" / "real_heads.q8_0.gguf"
PAGE = 256


def prompt_then_decode(backend: Backend[Any], prompt: list[int]) -> np.ndarray:
    sequence = backend.new_sequence()
    rows = [backend.to_host(backend.prefill(sequence, prompt))[0]]
    for token in (11, 12, 13):
        rows.append(backend.to_host(backend.decode([sequence], [token]))[0])
    return np.stack(rows)


@pytest.mark.parametrize("format_name", list(GPU_FORMATS))
def test_a_long_prompt_and_decode_steps_match_the_reference_in_the_same_format(format_name: str) -> None:
    model_file = ModelFile(ORACLE)
    gpu = CudaBackend(model_file, sequences=1, saved_states=0, context=1024, page_tokens=PAGE, kv=format_name)
    prompt = np.random.default_rng(4).integers(0, gpu.config.vocab_size, 600).tolist()
    assert gpu.stages[0].prompt is not None and gpu.stages[0].kv.format_name == format_name
    got = prompt_then_decode(gpu, prompt)
    reference = ReferenceBackend(model_file, mirror_gpu=True, page_tokens=PAGE, kv=format_name, rotated_attention=True)
    want = prompt_then_decode(reference, prompt)
    error = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    print(f"{format_name}: GPU vs reference per row {np.array2string(error, precision=2)}")
    assert error.max() <= 2e-2
    fp16 = CudaBackend(model_file, sequences=1, saved_states=0, context=1024, page_tokens=PAGE)
    assert np.abs(prompt_then_decode(fp16, prompt) - got).max() > 1e-4 * np.abs(got).max()
