"""The CUDA backend with a compressed KV cache (`--kv q8 | tq3 | q8k-tq3v`) under Numba's CUDA simulator, against
the reference backend in GPU-mirroring mode with the same format and rotated attention, as the GPU reads it.

The model is random, Q8_0, one attention layer with head size 128 (tq3's block). The simulator takes about a
minute a step, so tq3 alone runs here (about 5 minutes: both of its rotations, the query's and the output's),
one long-prompt step (32 rows: `kv_write` and prefill attention over the codes), the prompt's one-row tail and
one decode step (`kv_write` and decode attention over the codes); every format's kernels have their own
simulator tests, and every format runs through the whole backend on a GPU (`test_cuda_kv_formats_gpu.py`). Both sides
hold the same codes and round the same way but in fp32 summation order, so the bound is the whole-backend
simulator test's (test_cuda_backend_sim.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from cmpchat.backends.base import Backend
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.chat.template import builtin_template
from cmpchat.model.builder import build_model
from cmpchat.model.gguf_file import ModelFile
from tests.conftest import TINY_SHAPE, add_byte_vocabulary

PAGE = 128
PROMPT_ROWS = 32  # one long-prompt step of 32 rows: a prompt of 33 tokens leaves a one-row tail
PROMPT = [(7 * i + 3) % 200 for i in range(PROMPT_ROWS + 1)]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> ModelFile:
    path = tmp_path_factory.mktemp("kv-formats") / "attention-128.gguf"
    shape = replace(TINY_SHAPE, name="attention-128", num_layers=1, full_attention_interval=1, head_dim=128)
    build_model(path, shape, add_tokenizer=add_byte_vocabulary, chat_template=builtin_template(), seed=5)
    return ModelFile(path)


def prompt_then_decode(backend: Backend[Any]) -> list[np.ndarray]:
    sequence = backend.new_sequence()
    prompt = backend.to_host(backend.prefill(sequence, PROMPT))
    return [prompt, backend.to_host(backend.decode([sequence], [111]))]


@pytest.mark.slow
@pytest.mark.parametrize("format_name", ["tq3"])
def test_a_prompt_and_a_decode_step_match_the_reference_in_the_same_format(model_file, format_name):
    gpu = CudaBackend(model_file, sequences=1, saved_states=0, context=512, kv_tokens=4 * PAGE, page_tokens=PAGE,
                      prompt_rows=PROMPT_ROWS, kv=format_name)  # fmt: skip
    assert gpu.stages[0].prompt is not None, "the long-prompt step must run"
    assert gpu.stages[0].kv.format_name == format_name
    reference = ReferenceBackend(model_file, mirror_gpu=True, page_tokens=PAGE, kv=format_name,
                                 rotated_attention=True)  # fmt: skip
    for got, want in zip(prompt_then_decode(gpu), prompt_then_decode(reference), strict=True):
        assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
