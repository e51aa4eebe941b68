"""`GpuSampler`, under the simulator by default and on the GPU with `-m gpu`: each call selects from the
logits it is given.

Its selection graphs are captured once per batch size, with the address of a logits buffer bound in; a
step's logits come from several places (a decode step's rows, the last row of a prompt chunk, the
long-prompt step's own buffer), so whatever the caller passes must be what gets read."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.cuda.sampler import GpuSampler
from cmpchat.generation.sampling import SamplingParams

VOCAB = 96
ON_DEVICE = [pytest.param("simulator", id="sim"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("where", ON_DEVICE)
def test_each_call_selects_from_the_logits_it_is_given(where):
    stream = cuda.stream()
    step_rows = cuda.to_device(np.zeros((4, VOCAB), np.float32))  # a step's logits buffer
    sampler = GpuSampler(stream, use_graphs=True, logits_rows=step_rows)
    own_buffer = cuda.to_device(np.zeros((1, VOCAB), np.float32))  # e.g. the long-prompt step's
    rng = [np.random.default_rng(0)]
    greedy = [SamplingParams()]
    for source, row, winner in ((step_rows, 0, 5), (step_rows, 2, 17), (own_buffer, 0, 40), (step_rows, 0, 63)):
        host = np.zeros((source.shape[0], VOCAB), np.float32)
        host[row, winner] = 1.0
        source.copy_to_device(host)
        assert sampler.select(source[row : row + 1], greedy, [[]], rng) == [winner]
