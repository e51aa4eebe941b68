"""The CUDA backend's selection passes each row's grammar mask and log-probability request on to the GPU sampler
(under Numba's CUDA simulator, on the tiny model cut to two layers): a mask that allows one id chooses it, and the reported
log-probabilities are the raw logits' log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.base import Selector
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams, mask_words, token_logprobs


def test_a_rows_mask_and_logprobs_reach_the_gpu_sampler(two_layer_model):
    backend = CudaBackend(ModelFile(two_layer_model), sequences=1, saved_states=0, context=512, kv_tokens=512,
                          page_tokens=128)  # fmt: skip
    vocab = backend.config.vocab_size
    sequence = backend.new_sequence()
    logits = backend.prefill(sequence, [72, 33, 5])
    raw = backend.to_host(logits)[0]
    unlikely = int(np.argmin(raw))
    mask = np.zeros(mask_words(vocab), np.uint32)
    mask[unlikely // 32] |= np.uint32(1 << (unlikely % 32))
    choice = backend.select(logits, [Selector(SamplingParams(), [], np.random.default_rng(0), mask, logprobs=2)])
    assert choice.tokens() == [unlikely]
    (reported,) = choice.logprobs()
    expected = token_logprobs(raw, unlikely, 2)
    assert reported is not None and reported.token == unlikely
    assert reported.logprob == pytest.approx(expected.logprob, abs=1e-4)
    assert [t for t, _ in reported.top] == [t for t, _ in expected.top]
    backend.release(sequence)
