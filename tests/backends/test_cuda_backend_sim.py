"""The whole CUDA backend under Numba's CUDA simulator, on the tiny model, against the reference backend in
GPU-mirroring mode. The simulator runs the kernels' Python bodies with the intrinsics' fallbacks (no inline
PTX, no warp shuffles) and replays "graphs" launch by launch, about a minute a step at these shapes, so this is
one step that exercises the most: a forked sequence whose context ends one token before a page boundary reads
two tokens, so its first appends into a partial page shared with the original (copied on write) and its second
opens a new page. The GPU tests run longer comparisons on real hardware at real head sizes; the step inputs,
page tables and token feeding have their own simulator tests (test_cuda_step_transfers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.model.gguf_file import ModelFile

PAGE = 128  # the smallest page that holds whole attention tiles at the tiny model's head size 32
TOKENS = [72, 33]


@pytest.fixture(scope="module")
def backends(tiny_model_path):
    model_file = ModelFile(tiny_model_path)
    gpu = CudaBackend(model_file, sequences=1, saved_states=1, context=512, kv_tokens=4 * PAGE, page_tokens=PAGE)
    reference = ReferenceBackend(model_file, mirror_gpu=True, page_tokens=PAGE)
    return gpu, reference


@pytest.mark.slow
def test_a_fork_reading_across_a_shared_partial_page_matches_the_mirroring_reference(backends):
    gpu, reference = backends
    config = gpu.config
    context = PAGE - 1
    rng = np.random.default_rng(0)
    shape = (context, config.num_kv_heads, config.head_dim)
    history = {
        layer: [rng.standard_normal(shape).astype(np.float16) for _ in "kv"] for layer in config.attention_layers
    }

    # Both sides: a sequence that has read `context` tokens (random keys and values, zero recurrent state).
    original = gpu.new_sequence()
    gpu.skip_ahead(original, context)
    (page,) = original.pages.pages
    stage = gpu.stages[0]
    for layer, (keys, values) in history.items():
        stage.kv.keys[layer][page, :context].copy_to_device(keys)
        stage.kv.values[layer][page, :context].copy_to_device(values)
    expected_original = reference.new_sequence()
    expected_original.pages.grow(context)
    expected_original.next_position = context
    for layer, (keys, values) in history.items():
        reference.kv.write(layer, expected_original.pages.pages, 0, keys, values)

    fork, expected_fork = gpu.fork(original), reference.fork(expected_original)
    got = gpu.score(fork, TOKENS)
    expected = reference.score(expected_fork, TOKENS)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-3 * scale
    assert np.array_equal(got.argmax(axis=1), expected.argmax(axis=1))

    # The fork copied the shared partial page before writing into it, and took a new page for the second token.
    assert len(fork.pages.pages) == 2 and page not in fork.pages.pages and original.pages.pages == [page]
    for layer, (keys, _) in history.items():
        assert np.array_equal(stage.kv.keys[layer][page, :context].copy_to_host(), keys)  # the original is intact
        assert np.array_equal(stage.kv.keys[layer][fork.pages.pages[0], :context].copy_to_host(), keys)
    for sequence in (original, fork):
        gpu.release(sequence)
    assert gpu.pool.free_pages == gpu.pool.total_pages and gpu.held_sequences == 0
