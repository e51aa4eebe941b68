"""Batched decode must give each sequence the logits it gets alone; the scheduler relies on it.

Stated tolerance, relative to the largest logit magnitude: 1e-4 on the fp32 CPU reference (only the
summation order of the matmuls may differ) and 1e-2 on the GPU backend (batched kernels may tile and
round differently from the single-sequence path). The most likely token must agree everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmpchat.api import open_model
from cmpchat.backends.gpu.device import cuda_gpu_present

TOLERANCE = {"cpu": 1e-4, "cuda": 1e-2}


@pytest.mark.parametrize("backend_name", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batched_decode_logits_match_single_sequence_logits(tiny_model_path: Path, backend_name: str) -> None:
    if backend_name == "cuda" and not cuda_gpu_present():
        pytest.skip("no usable NVIDIA GPU")
    # Four batched sequences and their four copies.
    model = open_model(tiny_model_path, backend=backend_name, sequences=8, context=4096)  # type: ignore[arg-type]
    backend = model.backend
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=length).tolist() for length in (3, 17, 40, 9)]
    batched = [backend.new_sequence() for _ in prompts]
    for sequence, prompt in zip(batched, prompts, strict=True):
        backend.prefill(sequence, prompt)
    alone = [backend.fork(sequence) for sequence in batched]
    for _ in range(6):
        tokens = rng.integers(0, 256, size=len(prompts)).tolist()
        together = backend.to_host(backend.decode(batched, tokens))
        separate = np.stack(
            [backend.to_host(backend.decode([seq], [tok]))[0] for seq, tok in zip(alone, tokens, strict=True)]
        )
        scale = float(np.abs(separate).max())
        assert np.abs(together - separate).max() <= TOLERANCE[backend_name] * scale
        assert (together.argmax(axis=1) == separate.argmax(axis=1)).all()
    for sequence in batched + alone:
        backend.release(sequence)
